#!/bin/bash
# Every GPU check in one command, for a session lent a device (issues 4, 5, 18 and 19):
# the suite's CUDA tests (the Triton kernel tests natively on the GPU, the FP8 ones included,
# the sm_90 compile test, the roofline byte counts), the kernel timings (gpu_kernels.py), the
# graph path (gpu_check.py parts 1-4), FP8 checkpoints kept in FP8 with the
# gpu_memory_utilization profile run (gpu_check.py part 5 = gpu_fp8.py; FP8_ARGS, e.g.
# "--fp8-models qwen3-next --fp8-experts 32") and the roofline of a verify step at real shapes
# (roofline.py, batch 1 and 8, num_spec 0 and 3). Every log goes to one folder: $OUT (the device
# tool's folder) or ./gpu-logs. Missing Python packages travel as wheels in .whl/ (beartype is
# not on the device image). Each part runs under its own time limit (T_TESTS, T_KERNELS,
# T_CHECK, T_FP8 seconds, T_ROOF per roofline run; 0 skips that part): pick the parts that fit
# the session's device time (T_FP8=150 T_TESTS=150 with the others 0 checks issue 19 alone).
#   bash benchmarks/gpu_all.sh
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, triton, jaxtyping, beartype; print('torch', torch.__version__, 'triton', triton.__version__, 'jaxtyping', jaxtyping.__version__, 'beartype', beartype.__version__)"
start=$(date +%s)
if [ "${T_TESTS:-150}" != 0 ]; then
    MTPKIT_TRITON_TEST_DEVICE=cuda timeout "${T_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider \
        tests/test_triton_kernels.py tests/test_triton_compile.py tests/test_roofline.py 2>&1 | tee "$OUT/tests.log"
    echo "[tests: $(( $(date +%s) - start )) s]"
fi
start=$(date +%s)
if [ "${T_KERNELS:-150}" != 0 ]; then  # the kernel tests ran above: timings only
    timeout "${T_KERNELS:-150}" python3 benchmarks/gpu_kernels.py --no-tests --json "$OUT/kernels.json" 2>&1 | tee "$OUT/gpu_kernels.log"
    echo "[gpu_kernels: $(( $(date +%s) - start )) s]"
fi
start=$(date +%s)
if [ "${T_CHECK:-200}" != 0 ]; then
    timeout "${T_CHECK:-200}" python3 benchmarks/gpu_check.py ${CHECK_ARGS:-} 2>&1 | tee "$OUT/gpu_check.log"
    echo "[gpu_check: $(( $(date +%s) - start )) s]"
fi
start=$(date +%s)
if [ "${T_FP8:-150}" != 0 ]; then
    timeout "${T_FP8:-150}" python3 benchmarks/gpu_check.py --parts 5 ${FP8_ARGS:-} 2>&1 | tee "$OUT/gpu_fp8.log"
    echo "[gpu_fp8: $(( $(date +%s) - start )) s]"
fi
start=$(date +%s)
if [ "${T_ROOF:-90}" != 0 ]; then
    for spec in 0 3; do
        for batch in 1 8; do
            timeout "${T_ROOF:-90}" python3 benchmarks/roofline.py --layers "${ROOF_LAYERS:-4}" --batch $batch \
                --num-spec $spec --json "$OUT/roofline-b$batch-k$spec.json" 2>&1 | tee -a "$OUT/roofline.log"
        done
    done
    echo "[roofline: $(( $(date +%s) - start )) s]"
fi
