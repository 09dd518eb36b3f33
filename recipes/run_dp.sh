#!/usr/bin/env bash
# Data parallel: DP independent replicas of the whole model, the prompts split between them by
# tokens (prompt + max_tokens); rank 0 gathers the outputs and prints them in input order.
#
#   recipes/run_dp.sh                       # DP=2
#   MODEL=PATH DP=4 recipes/run_dp.sh --output out.jsonl
#
# On GPUs: set DP to the number of GPUs (one replica each; NCCL and cuda:LOCAL_RANK are automatic)
# and drop --eager. On a CPU host the replicas share the cores and the KV-cache memory budget.
# Each line of recipes/example_prompts.txt is a user message through the model's chat template
# (--chat; drop it for a base model without one). Extra options go to recipes/generate_distributed.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DP=${DP:-2}
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$DP" \
    recipes/generate_distributed.py ${MODEL:+--model "$MODEL"} --dp "$DP" --eager --chat "$@"
