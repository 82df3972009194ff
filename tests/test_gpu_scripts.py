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


def _gpu_all_plan(tmp_path, **env):
    """benchmarks/gpu_all.sh's dry run: (summary lines, [(part, cap s, log file)], skipped parts)."""
    import os
    import re
    import subprocess
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(root / "benchmarks" / "gpu_all.sh")], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "DRY_RUN": "1", "OUT": str(out), **env}, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = (out / "summary.log").read_text().splitlines()
    assert lines == run.stdout.splitlines()
    planned = (re.match(r"\[plan (.+?): cap (\d+) s -> (\S+)\]", ln) for ln in lines)
    plan = [(m[1], int(m[2]), m[3]) for m in planned if m]
    skipped = [m[1] for m in (re.match(r"\[skip (.+?): ", ln) for ln in lines) if m]
    return lines, plan, skipped


def test_gpu_all_fits_one_device_call(tmp_path):
    """By default the parts' caps add up to at most T_TOTAL = 540 s (one command may run 600 s),
    in priority order, the ones that do not fit skipped and named; at most 8 files come back."""
    lines, plan, skipped = _gpu_all_plan(tmp_path)
    names = [p for p, _, _ in plan]
    assert names[:3] == ["tests", "gpu_check", "roofline qwen3-next b1 k0"]
    assert sum(cap for _, cap, _ in plan) <= 540
    assert any(n.startswith("roofline gemma4") for n in names)
    qwen = [f"roofline qwen3-next b{b} k{k}" for k in (0, 3) for b in (1, 8)]
    assert names + skipped == (["tests", "gpu_check"] + qwen
                               + [f"roofline {m} b1 k{k}" for m in ("gemma4-26b-a4b", "gemma4-31b") for k in (0, 3)]
                               + ["gpu_kernels", "gpu_fp8"])
    assert "gpu_fp8" in skipped
    # summary.log, the logs the parts write, roofline.jsonl and kernels.json
    assert len({"summary.log", "roofline.jsonl", "kernels.json"} | {log for _, _, log in plan}) <= 8
    # A smaller budget caps the last part that starts by what is left, and skips the rest.
    _, plan, skipped = _gpu_all_plan(tmp_path, T_TOTAL="200")
    assert [(p, cap) for p, cap, _ in plan] == [("tests", 120), ("gpu_check", 80)]
    assert skipped[0] == "roofline qwen3-next b1 k0" and skipped[-1] == "gpu_fp8"
    # A second call for what the first skipped.
    _, plan, skipped = _gpu_all_plan(tmp_path, PARTS="kernels fp8")
    assert [p for p, _, _ in plan] == ["gpu_kernels", "gpu_fp8"] and skipped == []
