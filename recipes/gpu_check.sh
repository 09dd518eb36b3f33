#!/usr/bin/env bash
# GPU check (one CUDA machine, under 10 minutes), each step's output under OUT_DIR:
# 1. the attention kernels compiled natively by Triton against the torch reference;
# 2. the engine on CUDA against transformers on the same weights, eager, compiled (the whole step as
#    one graph), and compiled with CUDA-graph decode steps (recipes/gpu_parity.py);
# 3. one process launched by torchrun (the NCCL launch path at tp=1), against the same tokens;
# 4. decode on a Llama-3-8B-shaped random bf16 model: tokens/s at batch 1 and 64 per mode, and batch 1
#    as a fraction of HBM bandwidth (recipes/gpu_decode_bench.py; pass --hbm-tbps for other GPUs);
# 5. speculative decoding on a 1B-shaped target (n-gram, and a 2-layer cut of the target as draft):
#    greedy tokens equal plain greedy, acceptance, batch-1 speed-up (recipes/gpu_spec_check.py);
# 6. the KV CPU tier through pinned host memory: tokens equal with eviction + reload and with swap
#    preemption, and the host-device bandwidth of block copies (recipes/gpu_kv_tier_check.py);
# 7. MoE: the Triton grouped-GEMM experts kernel compiled natively against the oracle and the torch
#    reference (tests/toolkit/test_moe_triton.py), then at Mixtral/Qwen-MoE layer shapes in float32,
#    bfloat16 and float16 with times, a CUDA graph replayed on new routings, and Mixtral, Qwen2-MoE and
#    Qwen3-MoE checkpoints' greedy tokens against transformers with the kernel serving, eager, compiled
#    and with CUDA graphs (recipes/gpu_moe_check.py).
#   bash recipes/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
TOOLKIT_TEST_DEVICE=cuda timeout 180 python -m pytest -q tests/attention/test_triton.py tests/attention/test_reference.py \
  2>&1 | tee "$out/kernel_tests.log"
timeout 240 python recipes/gpu_parity.py 2>&1 | tee "$out/parity.log"
printf 'the cat sat on the mat\na list comprehension builds a list\n' > "$out/prompts.txt"
timeout 120 python recipes/generate_distributed.py --prompts "$out/prompts.txt" --output "$out/single.jsonl" --max-tokens 16
timeout 180 python -m torch.distributed.run --standalone --nproc-per-node 1 recipes/generate_distributed.py \
  --prompts "$out/prompts.txt" --output "$out/torchrun.jsonl" --max-tokens 16 2>&1 | tee "$out/torchrun.log"
python - "$out" <<'PY'
import json, sys
single, launched = (sys.argv[1] + f for f in ("/single.jsonl", "/torchrun.jsonl"))
tokens = lambda path: [json.loads(line)["token_ids"] for line in open(path)]
assert tokens(single) == tokens(launched), "torchrun's tokens differ from one process's"
print("torchrun tp=1: same tokens as one process")
PY
timeout 300 python recipes/gpu_decode_bench.py --out "$out/decode_bench.json" 2>&1 | tee "$out/decode_bench.log"
timeout 300 python recipes/gpu_spec_check.py --out "$out/spec.json" 2>&1 | tee "$out/spec.log"
timeout 240 python recipes/gpu_kv_tier_check.py --out "$out/kv_tiers.json" 2>&1 | tee "$out/kv_tiers.log"
TOOLKIT_TEST_DEVICE=cuda timeout 180 python -m pytest -q -p no:cacheprovider tests/toolkit/test_moe_triton.py \
  2>&1 | tee "$out/moe_kernel_tests.log"
timeout 480 python recipes/gpu_moe_check.py --out "$out/moe.json" 2>&1 | tee "$out/moe.log"
