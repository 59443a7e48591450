#!/usr/bin/env bash
# The GPU path's host-cost and tune-time figures in one device call (repo root; results in $OUT):
#   bash benchmarks/gpu_host_and_tune.sh
# 1. benchmarks/state_watch_cost.py on ResNet-50: the stale-weight watch's native reader against the Python path
#    (the first call builds the reader on that machine: NOTE [native watch]);
# 2. the default tune of BERT-base b32, then of ResNet-50 b1, in one cache directory: the ResNet-50 tune is then the
#    first of that model with the AOTInductor crash (if any) already remembered from the BERT tune;
# 3. benchmarks/wrapper_cost.py on ResNet-50 b1 with aitune's captured variant: host µs per call, stage by stage.
# 4. the GPU tests of Inductor and CUDA graphs (the weight watch runs in them);
# 5. "proxy": benchmarks/dispatch_host_cost.py, the dispatch's host cost on that machine's CPU alone (no GPU work;
#    PROXY_ARGS, e.g. "--flush 4": its arguments).
# STEPS: a subset of "watch search wrapper tests proxy" (default: the first four). BASELINE=DIR: the wrapper and
# proxy steps also run with the aitune package in DIR (a copy of an earlier tree's aitune/, e.g. made with
# `git archive REV aitune | tar -x -C DIR`) first on the import path, for a before/after on the same machine.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD AITUNE_CACHE_DIR=${AITUNE_CACHE_DIR:-/tmp/aitune-cache}
steps=${STEPS:-watch search wrapper tests}
quiet() { grep -v -E "UserWarning|warnings.warn|^W[0-9]{4}"; }
if [[ " $steps " == *" watch "* ]]; then
  python3 -m benchmarks.state_watch_cost --device cuda 2>&1 | tee "$OUT/state_watch_cost.log"
fi
if [[ " $steps " == *" search "* ]]; then
  IFS=, read -ra jobs <<< "${SEARCH_JOBS:-bert-base 32,resnet50 1}"  # (SEARCH_JOBS: "model batch,..." to tune)
  for job in "${jobs[@]}"; do
    set -- $job
    timeout ${SEARCH_TIMEOUT:-280} python3 -m benchmarks.gpu_search --model "$1" --batch "$2" --no-second-tune \
      --json "$OUT/search_$1_b$2.json" 2>&1 | quiet > "$OUT/search_$1_b$2.log"
    echo "search $1 b$2 rc ${PIPESTATUS[0]}"; tail -25 "$OUT/search_$1_b$2.log"
  done
fi
repo=$PWD
trees=("$PWD")
[[ -n "${BASELINE:-}" ]] && trees+=("$( [[ "$BASELINE" = /* ]] && echo "$BASELINE" || echo "$PWD/$BASELINE" )")
if [[ " $steps " == *" wrapper "* ]]; then
  for tree in "${trees[@]}"; do
    name=$( [[ "$tree" == "$PWD" ]] && echo now || echo baseline )
    # (run from another directory: `python -m` puts the working directory first on the import path)
    (cd /tmp && PYTHONPATH=$tree:$repo python3 -c "import aitune; print('aitune from', aitune.__file__)"
    PYTHONPATH=$tree:$repo timeout ${WRAPPER_TIMEOUT:-200} python3 -m benchmarks.wrapper_cost --device cuda \
      --model resnet50 --rounds 3 --calls 200 --grad off --stages 1000 --config captured+freezing+cl \
      ${WRAPPER_ARGS:-} 2>&1 | quiet \
      | tee "$OUT/wrapper_cost_$name.log")
  done
fi
if [[ " $steps " == *" proxy "* ]]; then
  for tree in "${trees[@]}"; do
    name=$( [[ "$tree" == "$PWD" ]] && echo now || echo baseline )
    (cd /tmp && PYTHONPATH=$tree:$repo python3 -c "import aitune; print('aitune from', aitune.__file__)"
    PYTHONPATH=$tree:$repo timeout ${PROXY_TIMEOUT:-200} python3 -m benchmarks.dispatch_host_cost --rounds 5 \
      --calls 2000 ${PROXY_ARGS:-} 2>&1 | quiet | tee "$OUT/dispatch_host_cost_$name.log")
  done
fi
if [[ " $steps " == *" tests "* ]]; then
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_graphs.py \
    tests/gpu/test_inductor_gpu.py 2>&1 | tail -30 > "$OUT/gpu_tests.log"
  echo "tests rc ${PIPESTATUS[0]}"; tail -5 "$OUT/gpu_tests.log"
fi
