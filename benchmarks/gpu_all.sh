#!/bin/bash
# Every GPU check in one command that fits one device call (issues 4, 5, 18, 19 and 33). A device
# session has 15 minutes of device time (machine start included) and one command may run 600 s,
# so the parts share one budget, T_TOTAL seconds (default 540) from the script's start, and run
# in priority order (what never ran on a GPU first):
#   fla-probe   benchmarks/gpu_fla_probe.py: fla-core's chunked GDN prefill against the
#               reference; unless it passes, MTPKIT_USE_FLA=0 for every later part (T_FLA)
#   tests       the suite's CUDA tests: the Triton kernel (state snapshots included), fused-MoE
#               and fused elementwise tests natively on the GPU (mtpkit's own kernels:
#               MTPKIT_USE_FLA=0), the sm_90 compile test, the roofline byte counts (T_TESTS)
#   wave        benchmarks/gpu_wave.py: this wave's features, CUDA graphs vs enforce_eager
#               (controls, structured output, logprobs, n samples, prefix caching, threads, the
#               memory plan's profile run, the Gemma 4 assistant, sliding-window recycling on
#               Triton, controls at real widths) (T_WAVE; WAVE_ARGS)
#   check       gpu_check.py parts 2, 4, 1, 3 in that order: the embedded model with MTP, Gemma 4
#               at real widths (never ran), graphs vs eager at real Qwen3-Next shapes, decode
#               latency (T_CHECK; CHECK_ARGS replaces "--parts 2 4 1 3")
#   roof-qwen   roofline.py, Qwen3-Next real shapes (ROOF_LAYERS layers), batch 1 and 8,
#               num_spec 0 and 3 (T_ROOF per run)
#   fp8         gpu_check.py part 5 = gpu_fp8.py, FP8 kept in FP8 (T_FP8; FP8_ARGS)
#   roof-gemma  roofline.py, Gemma 4 31B and 26B-A4B (ROOF_GEMMA_LAYERS layers, 5:1 sliding:full,
#               context ROOF_GEMMA_CONTEXT), batch 1, num_spec 0 and 3 with the assistant (T_ROOF)
#   kernels     gpu_kernels.py timings (the kernel tests ran under tests) (T_KERNELS)
# Each part (each roofline run) runs under min(its own limit, the time left), told as PART_CAP
# (gpu_wave.py stops starting checks 20 s before it); a part is skipped, and says so, when less
# than its minimum is left (a limit of 0 disables it). PARTS="fla-probe fp8 roof-gemma kernels"
# runs only the parts named (e.g. a second call for what the first skipped; without fla-probe,
# fla-core's prefill is used unchecked wherever it imports, unless MTPKIT_USE_FLA=0); ROOF_ARGS are added to every
# roofline run (e.g. "--experts 16 --vocab 2048" for a CPU run of the plumbing). DRY_RUN=1 prints
# the plan without running anything, as if every part took its whole cap (the worst case).
# At most 8 files come back from the device, so the logs are combined, 8 files in $OUT (the
# device tool's folder, else ./gpu-logs): summary.log (this plan: caps, times, exit codes,
# skipped parts, the fla probe's verdict), tests.log (the fla probe, then the tests), wave.log,
# gpu_check.log (parts 1-4, then part 5), roofline.log (every run), roofline.jsonl (every run's
# result, one line each), gpu_kernels.log, kernels.json.
# Missing Python packages travel as wheels in .whl/ (benchmarks/gpu_wheels.sh fetches them:
# beartype, llguidance, fla-core, jsonschema; the device image has neither), installed one by
# one so that a wheel of another Python version is passed over.
#   bash benchmarks/gpu_all.sh
#   DRY_RUN=1 bash benchmarks/gpu_all.sh
set -u
t0=$(date +%s)
OUT=${OUT:-gpu-logs}
T_TOTAL=${T_TOTAL:-540}
DRY_RUN=${DRY_RUN:-0}
PARTS=${PARTS:-fla-probe tests wave check roof-qwen fp8 roof-gemma kernels}
T_FLA=${T_FLA:-30} T_TESTS=${T_TESTS:-100} T_WAVE=${T_WAVE:-120} T_CHECK=${T_CHECK:-120} T_ROOF=${T_ROOF:-40} T_KERNELS=${T_KERNELS:-100} T_FP8=${T_FP8:-150}
ROOF_LAYERS=${ROOF_LAYERS:-4} ROOF_GEMMA_LAYERS=${ROOF_GEMMA_LAYERS:-6} ROOF_GEMMA_CONTEXT=${ROOF_GEMMA_CONTEXT:-2048}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.log"
: > "$SUMMARY"
simulated=0   # DRY_RUN: the seconds the parts planned so far would take at their caps

note() { echo "$*" | tee -a "$SUMMARY"; }
# (A dry run counts only the caps planned, not its own seconds: its plan is the same on a busy machine.)
left() { if [ "$DRY_RUN" != 0 ]; then echo $(( T_TOTAL - simulated )); else echo $(( T_TOTAL - ($(date +%s) - t0) )); fi; }
wanted() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# run_part NAME LIMIT MIN LOG CMD...: CMD under min(LIMIT, time left), its output appended to LOG.
run_part() {
    local name=$1 limit=$2 min=$3 log=$4; shift 4
    local rem cap start
    last_rc=skipped
    rem=$(left)
    if [ "$limit" = 0 ]; then note "[skip $name: its limit is 0]"; return; fi
    cap=$(( limit < rem ? limit : rem ))
    min=$(( min < limit ? min : limit ))   # a part given less than its usual minimum runs in what it was given
    if [ "$cap" -lt "$min" ]; then note "[skip $name: ${rem} s left of $T_TOTAL, it needs ${min} s]"; return; fi
    if [ "$DRY_RUN" != 0 ]; then
        note "[plan $name: cap ${cap} s -> ${log#$OUT/}] $*"
        simulated=$(( simulated + cap ))
        return
    fi
    start=$(date +%s)
    echo "== $name (cap ${cap} s): $*" >> "$log"
    PART_CAP=$cap timeout -k 5 "$cap" "$@" 2>&1 | tee -a "$log"
    last_rc=${PIPESTATUS[0]}
    note "[$name: $(( $(date +%s) - start )) s of cap ${cap} s, exit $last_rc$( [ "$last_rc" = 124 ] && echo ', timed out')]"
}

note "gpu_all.sh: budget $T_TOTAL s, parts: $PARTS$( [ "$DRY_RUN" != 0 ] && echo ' (dry run: nothing runs)')"
if [ "$DRY_RUN" = 0 ]; then
    # One install per package: pip picks the wheel of this Python among the cp310..cp313 ones,
    # and a package without one is named and passed over instead of stopping the others.
    for pkg in $(ls .whl/*.whl 2>/dev/null | xargs -n1 basename | cut -d- -f1 | sort -u); do
        if ! python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/site "$pkg" > /tmp/pip-install.log 2>&1; then
            note "[wheel $pkg: not installed: $(tail -1 /tmp/pip-install.log)]"
        fi
    done
    [ -d /tmp/site ] && export PYTHONPATH=/tmp/site
    export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
    nvidia-smi -L 2>&1 | tee -a "$SUMMARY"
    python3 -c "import torch, triton, jaxtyping, beartype; print('torch', torch.__version__, 'triton', triton.__version__, 'jaxtyping', jaxtyping.__version__, 'beartype', beartype.__version__)" 2>&1 | tee -a "$SUMMARY"
    for mod in llguidance fla jsonschema; do
        python3 -c "import $mod" 2>/dev/null && v=imports || v="does not import"
        note "[$mod: $v]"
    done
fi
XDIST=""
if [ "$DRY_RUN" = 0 ] && python3 -c "import xdist" 2>/dev/null; then XDIST="-n 8"; fi   # ~150 kernel compiles

if wanted fla-probe; then
    run_part fla-probe "$T_FLA" 15 "$OUT/tests.log" python3 benchmarks/gpu_fla_probe.py
    if [ "$DRY_RUN" = 0 ] && [ "$last_rc" != 0 ]; then
        export MTPKIT_USE_FLA=0
        note "[fla-core's prefill off for the later parts (MTPKIT_USE_FLA=0): the probe exited $last_rc]"
    fi
fi
if wanted tests; then
    # MTPKIT_USE_FLA=0: the tests check mtpkit's own kernels (the recurrent prefill too); fla's
    # prefill was checked by the probe.
    MTPKIT_USE_FLA=0 MTPKIT_TRITON_TEST_DEVICE=cuda run_part tests "$T_TESTS" 60 "$OUT/tests.log" python3 -m pytest -q -p no:cacheprovider $XDIST \
        tests/test_triton_kernels.py tests/test_triton_moe.py tests/test_triton_elementwise.py tests/test_triton_compile.py \
        tests/test_roofline.py
fi
if wanted wave; then
    run_part wave "$T_WAVE" 40 "$OUT/wave.log" python3 benchmarks/gpu_wave.py ${WAVE_ARGS:-}
fi
if wanted check; then
    run_part gpu_check "$T_CHECK" 60 "$OUT/gpu_check.log" python3 benchmarks/gpu_check.py ${CHECK_ARGS:---parts 2 4 1 3}
fi
if wanted roof-qwen; then
    for spec in 0 3; do
        for batch in 1 8; do
            run_part "roofline qwen3-next b$batch k$spec" "$T_ROOF" 30 "$OUT/roofline.log" python3 benchmarks/roofline.py \
                --layers "$ROOF_LAYERS" --batch $batch --num-spec $spec --jsonl "$OUT/roofline.jsonl" ${ROOF_ARGS:-}
        done
    done
fi
if wanted fp8; then
    run_part gpu_fp8 "$T_FP8" 60 "$OUT/gpu_check.log" python3 benchmarks/gpu_check.py --parts 5 ${FP8_ARGS:-}
fi
if wanted roof-gemma; then
    for model in gemma4-26b-a4b gemma4-31b; do
        for spec in 0 3; do
            run_part "roofline $model b1 k$spec" "$T_ROOF" 30 "$OUT/roofline.log" python3 benchmarks/roofline.py \
                --model $model --layers "$ROOF_GEMMA_LAYERS" --context "$ROOF_GEMMA_CONTEXT" --batch 1 --num-spec $spec \
                --jsonl "$OUT/roofline.jsonl" ${ROOF_ARGS:-}
        done
    done
fi
if wanted kernels; then
    run_part gpu_kernels "$T_KERNELS" 40 "$OUT/gpu_kernels.log" python3 benchmarks/gpu_kernels.py --no-tests \
        --json "$OUT/kernels.json"
fi
note "[gpu_all.sh: $(( $(date +%s) - t0 )) s$( [ "$DRY_RUN" != 0 ] && echo ", $simulated s planned") of $T_TOTAL]"
files=$(find "$OUT" -type f | wc -l)
if [ "$files" -gt 8 ]; then note "[warning: $files files in $OUT; the device returns at most 8]"; fi
