#!/usr/bin/env bash
# Text generation on the GPU (run through the device tool; figures land in $OUT):
#   bash benchmarks/gpu_llm.sh tests     the GPU tests of generation, then the benchmark
#   bash benchmarks/gpu_llm.sh           the benchmark only
# Environment: BATCHES (default "1"; e.g. "1 8"), TUNE_PROMPTS (prompt lengths the tune records, default
# "112 128"), BENCH_TIMEOUT (seconds per batch, default 400; a two-length tune plus the rounds needed ~560 s
# on the H200, so run the benchmark in a call of its own with BENCH_TIMEOUT=560 rather than after the tests),
# DECODE_CALLS (default 200: one decode call timed N x 3 times per path, call by call; 0: not timed),
# EXTRA (more arguments, e.g. "--no-output-copies").
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/env.txt"
if [ "${1:-}" = "tests" ]; then
  timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_llm_generation_gpu.py 2>&1 | tail -30 \
    | tee "$OUT/tests.log"
fi
for batch in ${BATCHES:-1}; do
  timeout ${BENCH_TIMEOUT:-400} python3 -m benchmarks.llm_generate --model qwen2-0.5b --device cuda --dtype bfloat16 \
    --batch $batch --tune-prompts ${TUNE_PROMPTS:-112 128} --prompt 128 --new-tokens 256 --rounds 3 --once eager-dynamic --decode-calls ${DECODE_CALLS:-200} ${EXTRA:-} \
    --json "$OUT/llm_b$batch.json" > "$OUT/llm_b$batch.log" 2>&1
  echo "benchmark b$batch rc $?"
  grep -v -i "warn" "$OUT/llm_b$batch.log" | grep -v "unavailable\|unsupported\|^\[" | tail -22
done
