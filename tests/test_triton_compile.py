"""The Triton kernels compile for a Hopper GPU (sm_90) without one.

test_triton_kernels.py checks the kernels' numbers under the Triton interpreter, which runs
them as numpy: it accepts programs a GPU compile refuses and cannot tell whether a tile fits
in shared memory. Here every launch the entry points make at real layer shapes (Qwen3-Next's
GDN, conv and head_dim-256 attention, its fused MoE experts and elementwise glue (norms with
the residual adds, the gated norm and activations, also at Gemma 4's widths), head_dim 512, a sliding window with softcap, bundles 1,
3 and 4, bf16 and fp32; the block-scaled FP8 matmul at decode and prefill sizes, in the block layout and with rows
naming their scale rows, and batched over expert stacks, gathered per token-expert pair or shared) is compiled for sm_90
through Triton's own ptxas
(tests/hopper_compile.py, in a process without TRITON_INTERPRET). Compiling says nothing about
the numbers: on an H200 the same kernels (all but the FP8 matmul, added later) passed test_triton_kernels.py natively
(benchmarks/gpu_kernels.py, results in benchmarks/results/).

The compile process must stay small (under MAX_RSS): a launch needs its arguments' dtypes,
strides and constexprs, not real-size tensors (real-size weights once took it to 17 GB, which
a 16 GB machine kills).
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
MAX_RSS = 3 * 2 ** 30   # bytes: what one test process may need


# The child runs under a small launcher: a process forked straight from this test process would
# report this process's high-water mark as its own (Linux keeps the RSS high-water of the mm a
# child was forked with across exec), so the launcher, exec'd first, forks the measured child
# from an image of its own size and reads its peak with os.wait4.
_LAUNCH = ("import os, subprocess, sys\n"
           "p = subprocess.Popen(sys.argv[2:])\n"
           "_, status, usage = os.wait4(p.pid, 0)\n"
           "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
           "sys.exit(os.waitstatus_to_exitcode(status))\n")


def run_measured(cmd: list[str], env: dict, timeout: float) -> tuple[int, str, str, int]:
    """(returncode, stdout, stderr, peak resident bytes) of `cmd`: its own peak, with the
    processes it waited for (ptxas), not this test process's nor any other child's."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            tempfile.NamedTemporaryFile("r") as peak:
        proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, peak.name, *cmd], stdout=out, stderr=err,
                                text=True, env=env, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            pytest.fail(f"{cmd} ran past {timeout} s")
        out.seek(0)
        err.seek(0)
        text = peak.read().strip()
        unit = 1 if sys.platform == "darwin" else 1024   # ru_maxrss: bytes on macOS, KiB on Linux
        return proc.returncode, out.read(), err.read(), int(text or 0) * unit


def test_the_measure_is_the_childs_own():
    """A child forked from a process holding 512 MiB reports them unless launched apart."""
    big = torch.ones(2 ** 27)    # 512 MiB resident here
    code, _, _, peak = run_measured([sys.executable, "-c", "pass"], dict(os.environ), 60)
    assert code == 0 and 0 < peak < 200 * 2 ** 20, peak
    code, _, _, peak = run_measured([sys.executable, "-c", "import sys; b = bytearray(300 * 2**20); sys.exit(3)"],
                                    dict(os.environ), 60)
    assert code == 3 and peak > 300 * 2 ** 20, peak
    del big


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent)] + [p for p in [env.get("PYTHONPATH")] if p])
    returncode, stdout, stderr, peak = run_measured([sys.executable, str(HERE / "hopper_compile.py")], env, 600)
    assert returncode == 0, f"peak RSS {peak / 2 ** 30:.2f} GiB\n{stderr[-4000:]}"
    return dict(json.loads(stdout.strip().splitlines()[-1]), peak_rss=peak)


@pytest.mark.slow
def test_every_launch_compiles_for_sm90(compiled):
    launches = compiled["launches"]
    kernels = {r["kernel"] for r in launches}
    # every kernel of the backend was launched and compiled
    assert kernels == {"_gdn_verify_kernel", "_gdn_prefill_kernel", "_conv_verify_kernel",
                       "_conv_prefill_out_kernel", "_conv_prefill_state_kernel", "_paged_verify_kernel",
                       "_merge_splits_kernel", "_paged_prefill_kernel", "_fp8_block_matmul_kernel",
                       "_moe_gate_up_kernel", "_moe_down_kernel", "_residual_norm_kernel",
                       "_gated_rms_norm_kernel", "_act_mul_kernel"}
    failed = [r for r in launches if "error" in r]
    assert not failed, "\n".join(f"{r['kernel']} {r['constexprs']} {r['options']}: {r['error']}" for r in failed)
    assert all(r["cubin_bytes"] > 0 for r in launches)


@pytest.mark.slow
def test_compiling_stays_under_the_memory_limit(compiled):
    peak = compiled["peak_rss"]
    assert 0 < peak < MAX_RSS, f"hopper_compile.py peaked at {peak / 2 ** 30:.2f} GiB resident (limit {MAX_RSS / 2 ** 30:.0f} GiB)"


@pytest.mark.slow
def test_every_launch_fits_sm90_shared_memory(compiled):
    limit = compiled["sm90_shared"]
    over = [r for r in compiled["launches"] if r.get("shared", 0) > limit]
    assert not over, "\n".join(f"{r['kernel']} {r['constexprs']}: {r['shared']} B > {limit} B" for r in over)


@pytest.mark.slow
def test_launches_take_the_gpu_decisions(compiled):
    """The recorded launches are the GPU's: 16-bit attention on the tensor cores, split KV, and
    compiled as the JIT specializes them for CUDA tensors (aligned pointers marked divisible by
    16, which changes the code and its shared memory)."""
    assert all(r["divisible_args"] > 0 for r in compiled["launches"] if "error" not in r)
    paged = [r for r in compiled["launches"] if r["kernel"] == "_paged_verify_kernel"]
    assert any(r["constexprs"]["NATIVE"] for r in paged)
    assert any(not r["constexprs"]["DOT16"] for r in paged)   # the fp32 path too
    assert {r["constexprs"]["BM"] for r in paged} == {16, 32}
    assert all(r["constexprs"]["SPLITS"] > 1 for r in paged)
