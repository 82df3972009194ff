#!/usr/bin/env bash
# Two checkouts of mtpkit timed alternately in rounds (the machine is noisy: each round runs both
# under the same load), per model and num_spec; prints each round's before/after ratio (> 1: the
# second tree is faster).  bash benchmarks/compare_trees.sh /tmp/old-checkout /tmp/new-checkout [rounds]
set -euo pipefail
A=$1; B=$2; ROUNDS=${3:-5}
RUN="$(cd "$(dirname "$0")" && pwd)/compare_trees_run.py"
for model in tiny-qwen3-next tiny-gemma4; do for k in 0 3; do
  for r in $(seq "$ROUNDS"); do
    a=$(cd "$A" && PYTHONPATH="$A" python "$RUN" $model $k 2>/dev/null | tail -1)
    b=$(cd "$B" && PYTHONPATH="$B" python "$RUN" $model $k 2>/dev/null | tail -1)
    echo "$model k=$k round $r before $a after $b ratio $(python -c "print(round($a / $b, 3))")"
  done
done; done
