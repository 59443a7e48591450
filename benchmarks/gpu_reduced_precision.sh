#!/usr/bin/env bash
# fp32 models on the H200 (issue "Search", seventh session): aitune's bf16-autocast Inductor variant selected with
# allow_reduced_precision=True, against eager fp32 and the hand-picked reduce-overhead (+ freezing, + bf16 autocast)
# anchors, in one process per model. Run through the device tool (repo root): bash benchmarks/gpu_reduced_precision.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export AITUNE_CACHE_DIR=${AITUNE_CACHE_DIR:-/tmp/aitune-cache}
for spec in "bert-base 32" "resnet50 32"; do
  set -- $spec
  OUT_TAG=_fp32 timeout 280 bash benchmarks/gpu_search.sh "$1" "$2" --dtype float32 --allow-reduced-precision \
    --no-second-tune > /dev/null 2>&1
  tail -12 "$OUT/${1}_b${2}_fp32.log"
done
