#!/usr/bin/env bash
# ONNX Runtime's CUDA EP on the H200, after onnxruntime-gpu was brought in parts (../shared/tools/gpu-ort-chunks:
# run its part calls first, back to back, then this as the last call). Output lands in $OUT:
#   bash benchmarks/gpu_ort_checks.sh
# 1. the wheel installed from the parts; the providers listed;
# 2. the GPU tests of ONNX Runtime and of generation (pytest);
# 3. benchmarks/gpu_ort.py: every ONNX Runtime variant against eager and reduce-overhead (ResNet-50 b1/b32,
#    BERT-base b32 x 128);
# 4. the default tune of BERT-base b32 with ONNX Runtime's CUDA EP available (benchmarks/gpu_search.py; SEARCH=0
#    skips it). ORT_ARGS: more arguments of benchmarks/gpu_ort.py (e.g. --kernel-profile).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# pip refuses a wheel whose file name lacks the version: the name is the wheel's own
wheel=/tmp/ortwhl/onnxruntime_gpu-${ORT_GPU_VERSION:-1.31.1}-cp312-cp312-manylinux_2_28_x86_64.whl
mkdir -p /tmp/ortwhl && cat /tmp/ortparts/part* > "$wheel" \
  && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheel" \
  || { echo "onnxruntime-gpu could not be installed from /tmp/ortparts"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD AITUNE_CACHE_DIR=/tmp/aitune-cache
python3 -c "import torch, onnxruntime as o; print(torch.__version__, o.__version__, o.get_available_providers())" \
  | tee "$OUT/env.txt"
grep -q CUDAExecutionProvider "$OUT/env.txt" || { echo "the CUDA EP is not available: nothing to measure"; exit 1; }
tests=${TESTS:-tests/gpu/test_onnxruntime_gpu.py tests/gpu/test_llm_generation_gpu.py}
timeout ${TESTS_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider $tests 2>&1 | tail -40 > "$OUT/tests.log"
echo "tests rc ${PIPESTATUS[0]}"; tail -5 "$OUT/tests.log"
timeout ${ORT_TIMEOUT:-230} python3 -m benchmarks.gpu_ort --rounds 3 --calls 30 --json "$OUT/gpu_ort.json" \
  ${ORT_ARGS:-} > "$OUT/gpu_ort.log" 2>&1
echo "gpu_ort rc $?"; grep -E "^(resnet50|bert)|kernels of" "$OUT/gpu_ort.log"
[ "${SEARCH:-1}" = 1 ] || exit 0
timeout ${SEARCH_TIMEOUT:-140} python3 -m benchmarks.gpu_search --model bert-base --batch 32 --no-second-tune \
  --json "$OUT/bert_b32_search.json" 2>&1 | grep -v -E "UserWarning|warnings.warn|^W[0-9]{4}" \
  > "$OUT/bert_b32_search.log"
echo "search rc ${PIPESTATUS[0]}"; tail -30 "$OUT/bert_b32_search.log"
