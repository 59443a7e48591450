#!/usr/bin/env bash
# Where a tuned module's host time per call goes on the GPU machine, stage by stage (benchmarks/dispatch_stages.py),
# run through the device tool; output lands in $OUT:
#   bash benchmarks/gpu_host_stages.sh
# 1. one decode call of the Qwen2-0.5B-sized decoder (bf16, Inductor reduce-overhead) + a cProfile of generate;
# 2. ResNet-50 b1 fp16 under Inductor reduce-overhead + freezing, next to the compiled callable called directly.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/env.txt"
timeout ${LLM_TIMEOUT:-330} python3 -m benchmarks.llm_decode_host --device cuda --dtype bfloat16 --model qwen2-0.5b \
  --stages ${LLM_CALLS:-300} > "$OUT/llm_host.txt" 2>&1
echo "llm rc $?"
grep -A16 "stage by stage" "$OUT/llm_host.txt"
timeout ${RESNET_TIMEOUT:-200} python3 -m benchmarks.wrapper_cost --device cuda --model resnet50 --rounds 3 --calls 200 \
  --grad off --stages ${RESNET_CALLS:-1000} --config reduce-overhead+freezing > "$OUT/resnet_stages.txt" 2>&1
echo "resnet rc $?"
grep -v -i "warn" "$OUT/resnet_stages.txt" | tail -20
