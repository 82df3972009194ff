"""The GPU check scripts' CPU-side logic (they run for real only on a GPU session): part 5 of
benchmarks/gpu_check.py (benchmarks/gpu_fp8.py) writes FP8 checkpoints and their twins,
loads them kept in FP8, plans memory and compares graphs with eager, here at tiny widths on
the CPU (its kernel-vs-reference comparison is then the reference against itself)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402


def test_gpu_check_fp8_part_dry_run(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--device", "cpu", "--parts", "5", "--fp8-widths", "tiny",
                                      "--fp8-experts", "4", "--fp8-vocab", "512", "--fp8-prompt-len", "12",
                                      "--fp8-max-tokens", "4"])
    assert gpu_check.main() == 0
    out = capsys.readouterr().out
    assert out.count("== 5. FP8") == 2 and "gpu_check: all checks passed" in out
    assert out.count("greedy tokens, graphs vs eager (kept FP8): same True") == 2
    kept = [ln for ln in out.splitlines() if ln.startswith("kept:")]
    assert len(kept) == 2 and all("with named scale rows" in ln for ln in kept)
