#!/bin/bash
# The wheels the GPU device needs and its image lacks, into the ignored .whl/ (carried by the
# device call; benchmarks/gpu_all.sh installs them with --no-deps --target /tmp/site). Run here,
# in the repository root, where PyPI is reachable; the device reaches nothing.
#   beartype                  mtpkit's shape checks (mtpkit/shapes.py, at import)
#   llguidance                structured outputs (mtpkit/structured/, at import); Rust, abi3
#   fla-core                  the `gpu` extra: fla's chunked GDN prefill kernel (pure Python)
#   jsonschema + its needs    gpu_wave.py validates JSON outputs against their schema
#                             (referencing, jsonschema-specifications; rpds-py is compiled)
# The device image has torch, Triton, jaxtyping, einops, safetensors, tokenizers, jinja2,
# huggingface_hub, accelerate, tqdm and attrs (/work/.library/device/KINDS.md); flash-attn has no
# wheel on PyPI (it builds from source with nvcc) and stays off. Its Python version is not
# known (3.12.3 was seen): compiled wheels come for cp310..cp313 and the install picks the one
# that matches. Versions: the ones this repository's venv runs.
#   bash benchmarks/gpu_wheels.sh        # then carry ".whl" in the device call (docs/gpu.md)
set -eu
cd "$(dirname "$0")/.."
DEST=${DEST:-.whl}
mkdir -p "$DEST"
PURE="beartype==0.23.1 fla-core==0.6.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0"
COMPILED="llguidance==1.9.1 rpds-py==2026.9.1"
PLATFORMS=""
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
    PLATFORMS="$PLATFORMS --platform $p"
done
PIP="python3 -m pip download -q --no-deps --only-binary=:all: -d $DEST"
# shellcheck disable=SC2086
$PIP --python-version 3.12 --implementation cp $PLATFORMS $PURE
missing=""
for v in 3.10 3.11 3.12 3.13; do
    for pkg in $COMPILED; do
        # shellcheck disable=SC2086
        $PIP --python-version "$v" --implementation cp $PLATFORMS "$pkg" || missing="$missing $pkg(cp$v)"
    done
done
ls -l "$DEST"
du -sh "$DEST"
if [ -n "$missing" ]; then echo "gpu_wheels.sh: no wheel for:$missing" >&2; fi
