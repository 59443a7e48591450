#!/usr/bin/env bash
# Kernel selector timed inside CUDA graphs (issue "Search", item 1), on the H200: the kernel-forge GPU tests,
# then the attention sweep at the shapes (fp16, batch 2, 16 heads, causal, sequence 1k-16k, head dim
# 64/128) with every provider timed from Python and inside CUDA graphs, the plan made on it, and the
# transformer block through the KernelSelectorBackend (Inductor JIT delegate). Run through the device tool
# with carry [".whl"] (../shared/tools/gpu-wheels: sageattention).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
timeout 300 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_kernels_gpu.py > "$OUT/pytest_kernels.log" 2>&1
grep -E "passed|failed|error" "$OUT/pytest_kernels.log" | tail -5
# PyTorch's math kernel is left out of the sweep (0.02-0.10x SDPA at 1k-4k on 2026-12-01; minutes at 16k).
timeout 420 python3 -m benchmarks.attention_kernels --batch 2 --heads 16 --causal --seq 1024 2048 4096 8192 16384 \
  --head-dim 64 128 --providers flash cudnn efficient sage --budget-s 0.3 --json "$OUT/attention_causal.json" \
  > "$OUT/attention_causal.log" 2>&1
grep -v -E "^seq|^block|arn" "$OUT/attention_causal.log" | tail -20
