#!/bin/bash
# Every GPU check in one command, for a session lent a device (issues 4 and 5):
# the Triton kernels (tests on CUDA + timings) and the graph path (gpu_check.py).
# Logs go to $OUT (the device tool's folder) or ./gpu-logs. Missing Python packages travel
# as wheels in .whl/ (beartype is not on the device image).
#   bash benchmarks/gpu_all.sh            # both, each under its own time limit
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
if [ "${T_KERNELS:-200}" != 0 ]; then  # T_KERNELS=0: the graph check alone
    timeout "${T_KERNELS:-200}" python3 benchmarks/gpu_kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/gpu_kernels.log"
    echo "[gpu_kernels: $(( $(date +%s) - start )) s]"
fi
start=$(date +%s)
timeout "${T_CHECK:-240}" python3 benchmarks/gpu_check.py ${CHECK_ARGS:-} 2>&1 | tee "$OUT/gpu_check.log"
echo "[gpu_check: $(( $(date +%s) - start )) s]"
