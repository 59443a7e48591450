#!/usr/bin/env bash
# Issue "Search" figures on the H200 (device tool, repo root; wheels from ../shared/tools/gpu-wheels in .whl/,
# carried). Usage: bash benchmarks/gpu_search.sh resnet50 1   |   bash benchmarks/gpu_search.sh bert-base 32
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD
export AITUNE_CACHE_DIR=${AITUNE_CACHE_DIR:-/tmp/aitune-cache}
model=${1:-resnet50}; batch=${2:-1}; shift 2 || true
name="${model}_b${batch}${OUT_TAG:-}"  # OUT_TAG: a suffix for the result files of a repeated run
python3 -m benchmarks.gpu_search --model "$model" --batch "$batch" --json "$OUT/$name.json" "$@" 2>&1 \
  | grep -v -E "UserWarning|warnings.warn|^W[0-9]{4}" | tee "$OUT/$name.log"
