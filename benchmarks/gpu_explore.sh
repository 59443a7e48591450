#!/usr/bin/env bash
# Issue "Search" exploration on the H200 (device tool, repo root, .whl carried): which torch.compile variants
# beat reduce-overhead + freezing, each alone in a fresh process. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -m benchmarks.gpu_freezing --model resnet50 --batch 1 --timeout 200 \
  --variants "${RESNET_VARIANTS:-ro,ro_freeze_global,ma_freeze_global,ro_freeze_global_cdt}" \
  --json "$OUT/gpu_freezing_resnet50_b1.json" 2>&1 | tee "$OUT/resnet.log"
python3 -m benchmarks.gpu_freezing --model bert-base --batch 32 --timeout 200 \
  --variants "${BERT_VARIANTS:-ro,ma}" --json "$OUT/gpu_freezing_bert-base_b32.json" 2>&1 | tee "$OUT/bert.log"
