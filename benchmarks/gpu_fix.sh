#!/usr/bin/env bash
# Third H200 batch: the GPU test suite after fixes, and TorchAO fp8 on BERT-base fp16 (carry [".whl"]).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not aot" -rs > "$OUT/pytest_gpu.log" 2>&1
tail -25 "$OUT/pytest_gpu.log"
timeout 250 python3 -m benchmarks.harness --model bert-base --device cuda --dtype float16 --batch 1 32 \
  --backends torchao eager:use_cuda_graphs=true --budget-s 1.0 \
  --json "$OUT/bert_torchao.json" 2>&1 | grep -v -i warn > "$OUT/bert_torchao.log"
grep -E "^\| bert|selected:|re-timed" "$OUT/bert_torchao.log" | sort -u
