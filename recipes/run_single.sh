#!/usr/bin/env bash
# One process, one device: offline batch generation with `toolkit generate`.
#
# Runs as-is on a CPU machine (after `make setup`): the built-in model (a seeded random tiny Llama
# until recipes/train_default_model.py has been run), eager mode for a quick start, a small KV cache.
# Rerunning resumes: lines that already have a record in the output are skipped.
#
#   recipes/run_single.sh                       # the example inputs, outputs under out/run_single/
#   MODEL=/path/to/hf-model recipes/run_single.sh
#
# On a GPU, change the engine flags below to:
#   --dtype bfloat16                 # instead of auto (float32 checkpoints stay float32 otherwise)
#   drop --eager                     # torch.compile pays for itself past a few hundred steps
#   drop --kv-cache-memory           # default: 90% of free GPU memory (or give e.g. 40GiB)
#   --max-num-seqs 256 --max-num-batched-tokens 8192   # bigger steps keep the GPU busy
# Attention uses the Triton kernels on CUDA by default (--attention-backend torch to compare).
set -euo pipefail
cd "$(dirname "$0")/.."

TOOLKIT=${TOOLKIT:-.venv/bin/toolkit}
OUT=${OUT:-out/run_single}
MODEL_FLAGS=()
if [[ -n "${MODEL:-}" ]]; then MODEL_FLAGS=(--model "$MODEL"); fi
ENGINE_FLAGS=(--eager --kv-cache-memory 256MiB --max-num-seqs 16 --max-model-len 512)
mkdir -p "$OUT"

# Plain text, one prompt per line; each record's id is its line number.
"$TOOLKIT" generate "${MODEL_FLAGS[@]}" "${ENGINE_FLAGS[@]}" \
    --input recipes/example_prompts.txt --output "$OUT/prompts.jsonl" --max-tokens 64 --temperature 0

# OpenAI Batch API requests (chat and completions), answered in the OpenAI Batch output format.
"$TOOLKIT" generate "${MODEL_FLAGS[@]}" "${ENGINE_FLAGS[@]}" \
    --input recipes/example_batch.jsonl --output "$OUT/batch.jsonl"

echo "records: $OUT/prompts.jsonl $OUT/batch.jsonl" >&2
