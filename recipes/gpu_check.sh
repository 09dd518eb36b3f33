#!/usr/bin/env bash
# GPU check (one CUDA machine, under 8 minutes): the attention kernels compiled natively against the
# torch reference, then the decode benchmark on a Llama-3-8B-shaped random bf16 model.
#   bash recipes/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
# Kernel tests with real Triton compilation (no interpreter) on the GPU.
TOOLKIT_TEST_DEVICE=cuda timeout 180 python -m pytest -q tests/test_attention_triton.py tests/test_attention.py \
  2>&1 | tee "$out/kernel_tests.log"
timeout 300 python recipes/gpu_decode_bench.py --out "$out/decode_bench.json" 2>&1 | tee "$out/decode_bench.log"
