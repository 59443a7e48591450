#!/usr/bin/env bash
# GPU figures for issue 2 (run through the device tool on the H200; results land in $OUT).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
for model in resnet50 bert-base; do
  python3 -m benchmarks.harness --model $model --device cuda --dtype float16 --batch 1 32 \
    --backends inductor_jit inductor_jit:reduce-overhead --budget-s 1.5 --json "$OUT/$model.json" 2>&1 \
    | grep -v -i "warn" | tee "$OUT/$model.log"
done
