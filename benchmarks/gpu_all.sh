#!/usr/bin/env bash
# Second H200 batch: ResNet-50 with eager+CUDA graphs, TorchAO fp8 on BERT-base, the attention-kernel sweep,
# and the GPU test suite. Run through the device tool with carry [".whl"].
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
python3 -m benchmarks.harness --model resnet50 --device cuda --dtype float16 --batch 1 32 \
  --backends eager:use_cuda_graphs=true inductor_jit:reduce-overhead --atol 0.25 --rtol 0.05 --budget-s 1.0 \
  --json "$OUT/resnet50.json" 2>&1 | grep -v -i warn > "$OUT/resnet50.log"
tail -5 "$OUT/resnet50.log"
python3 -m benchmarks.harness --model bert-base --device cuda --dtype float16 --batch 1 32 \
  --backends torchao inductor_jit:reduce-overhead eager:use_cuda_graphs=true --budget-s 1.0 \
  --json "$OUT/bert_torchao.json" 2>&1 | grep -v -i warn > "$OUT/bert_torchao.log"
tail -5 "$OUT/bert_torchao.log"
timeout 200 python3 -m benchmarks.attention_kernels --json "$OUT/attention.json" > "$OUT/attention.log" 2>&1
tail -30 "$OUT/attention.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not aot" > "$OUT/pytest_gpu.log" 2>&1
tail -15 "$OUT/pytest_gpu.log"
