#!/usr/bin/env bash
# Issue "Search" on the H200 in one device call (repo root, .whl carried): the default tune of ResNet-50 b1 and
# BERT-base b32 against hand-picked torch.compile, then where the wrapped module's time goes. Results under $OUT.
# ResNet-50 runs first with a fresh aitune cache (the first tune ever on this machine: it meets the AOTInductor
# load crash); BERT-base and ResNet-50 once more then run each with a cache that knows only that crash
# (crashes.json copied: the first tune of a model on a machine aitune has tuned on before).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
AITUNE_CACHE_DIR=/tmp/aitune-cache-resnet timeout 210 bash benchmarks/gpu_search.sh resnet50 1 > /dev/null 2>&1
tail -12 "$OUT/resnet50_b1.log"
cp /tmp/aitune-cache-resnet/resnet50-b1/graph0/TorchInductorAot*/aoti_compile.log "$OUT/aoti_compile_resnet.log" 2>/dev/null
for cache in /tmp/aitune-cache-bert /tmp/aitune-cache-known; do
  mkdir -p "$cache" && cp /tmp/aitune-cache-resnet/crashes.json "$cache/" 2>/dev/null
done
AITUNE_CACHE_DIR=/tmp/aitune-cache-bert timeout 180 bash benchmarks/gpu_search.sh bert-base 32 > /dev/null 2>&1
tail -12 "$OUT/bert-base_b32.log"
AITUNE_CACHE_DIR=/tmp/aitune-cache-known OUT_TAG=_crash_known timeout 140 bash benchmarks/gpu_search.sh resnet50 1 \
  --no-second-tune > /dev/null 2>&1
tail -7 "$OUT/resnet50_b1_crash_known.log"
PYTHONPATH=/tmp/site:$PWD timeout 110 python3 -m benchmarks.gpu_wrapper_cost --freezing 1 --json "$OUT/wrapper_cost.json" \
  2>&1 | grep -v -E "UserWarning|warnings.warn|^W[0-9]{4}" | tail -24
