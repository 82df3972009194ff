"""The GPU check scripts' CPU-side logic (they run for real only on a GPU session): part 5 of
benchmarks/gpu_check.py (benchmarks/gpu_fp8.py) writes FP8 checkpoints and their twins,
loads them kept in FP8, plans memory and compares graphs with eager, here at tiny widths on
the CPU (its kernel-vs-reference comparison is then the reference against itself);
benchmarks/gpu_wave.py's checks of this wave's features (graphs vs eager, on vs off) pass on
the CPU, and one compared against a perturbed run fails with a non-zero exit; gpu_all.sh's
dry-run plan."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_wave  # noqa: E402


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


def test_gpu_wave_checks_pass_on_cpu(capsys):
    """Every check of gpu_wave.py, the same logic the GPU runs, at tiny sizes on the CPU
    ("graphs" is the CPU trace of the captured steps there)."""
    assert gpu_wave.main(["--device", "cpu", "--max-tokens", "4", "--real-shrink"]) == 0
    out = capsys.readouterr().out
    passed = [ln.split()[1] for ln in out.splitlines() if ln.startswith("PASS ")]
    assert passed == gpu_wave.CHECKS
    assert f"gpu_wave: {len(gpu_wave.CHECKS)} PASS, 0 FAIL, 0 SKIP" in out


def test_gpu_wave_reports_a_planted_fault_and_goes_on(capsys):
    """A check compared against a perturbed run FAILs with the first difference, the next check
    still runs, the exit code is 1; a spent budget SKIPs the rest (exit 3): 0.01 s lets the first
    check start (microseconds in) and is spent by its end on any machine (the check loads models)."""
    assert gpu_wave.main(["--device", "cpu", "--max-tokens", "4", "--checks", "n", "logprobs",
                          "--plant-fault", "n"]) == 1
    out = capsys.readouterr().out
    fail = next(ln for ln in out.splitlines() if ln.startswith("FAIL n "))
    assert "first" not in fail and "n=4 graphs vs eager: output 3, token 3:" in fail
    assert "PASS logprobs" in out and "gpu_wave: 1 PASS, 1 FAIL, 0 SKIP" in out
    assert gpu_wave.main(["--device", "cpu", "--checks", "logprobs", "n", "--max-tokens", "2", "--budget", "0.01"]) == 3
    out = capsys.readouterr().out
    assert "PASS logprobs" in out and "SKIP n: out of time" in out


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
    qwen = [f"roofline qwen3-next b{b} k{k}" for k in (0, 3) for b in (1, 8)]
    # What never ran on a GPU first: the fla probe, the kernel tests, this wave's checks.
    assert names == ["fla-probe", "tests", "wave", "gpu_check"] + qwen
    assert sum(cap for _, cap, _ in plan) <= 540
    assert skipped == (["gpu_fp8"] + [f"roofline {m} b1 k{k}" for m in ("gemma4-26b-a4b", "gemma4-31b") for k in (0, 3)]
                       + ["gpu_kernels"])
    wave = next(ln for ln in lines if ln.startswith("[plan wave:"))
    assert "benchmarks/gpu_wave.py" in wave and "-> wave.log]" in wave
    tests = next(ln for ln in lines if ln.startswith("[plan tests:"))
    assert "tests/test_triton_kernels.py" in tests and "tests/test_triton_elementwise.py" in tests
    # summary.log, the logs the parts write, roofline.jsonl and kernels.json
    assert len({"summary.log", "roofline.jsonl", "kernels.json"} | {log for _, _, log in plan}) <= 8
    # A smaller budget caps the last part that starts by what is left, and skips the rest.
    _, plan, skipped = _gpu_all_plan(tmp_path, T_TOTAL="200")
    assert [(p, cap) for p, cap, _ in plan] == [("fla-probe", 30), ("tests", 100), ("wave", 70)]
    assert skipped[0] == "gpu_check" and skipped[-1] == "gpu_kernels"
    # A second call for what the first skipped.
    _, plan, skipped = _gpu_all_plan(tmp_path, PARTS="fla-probe fp8 roof-gemma kernels")
    assert [p for p, _, _ in plan] == (["fla-probe", "gpu_fp8"] + [f"roofline {m} b1 k{k}" for m in ("gemma4-26b-a4b", "gemma4-31b")
                                                      for k in (0, 3)] + ["gpu_kernels"]) and skipped == []
