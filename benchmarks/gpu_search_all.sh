#!/usr/bin/env bash
# Issue "Search" on the H200 in one device call (repo root, .whl carried): the default tune of ResNet-50 b1 and
# BERT-base b32 against hand-picked torch.compile (each model with its own fresh aitune cache: both first
# tunes are first tunes), then where the wrapped module's time goes. Results under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
AITUNE_CACHE_DIR=/tmp/aitune-cache-resnet timeout 250 bash benchmarks/gpu_search.sh resnet50 1 > /dev/null 2>&1
tail -8 "$OUT/resnet50_b1.log"
AITUNE_CACHE_DIR=/tmp/aitune-cache-bert timeout 220 bash benchmarks/gpu_search.sh bert-base 32 > /dev/null 2>&1
tail -8 "$OUT/bert-base_b32.log"
PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m benchmarks.gpu_wrapper_cost --freezing 1 --json "$OUT/wrapper_cost.json" \
  2>&1 | grep -v -E "UserWarning|warnings.warn|^W[0-9]{4}" | tail -12
