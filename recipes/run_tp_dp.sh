#!/usr/bin/env bash
# Both: DP replicas x TP processes each, one (dp, tp) device mesh. Ranks 0..TP-1 are replica 0,
# the next TP ranks replica 1, ... (tp is the innermost mesh dimension, so a TP group is
# consecutive ranks: on GPUs, devices of one node, where the all-reduces are fastest).
#
#   recipes/run_tp_dp.sh                    # DP=2 x TP=2 = 4 processes
#
# On GPUs: TP x DP = the GPUs of the node (e.g. TP=4 DP=2 on 8 GPUs); drop --eager.
# Each line of recipes/example_prompts.txt is a user message through the model's chat template
# (--chat; drop it for a base model without one). Extra options go to recipes/generate_distributed.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TP=${TP:-2}
DP=${DP:-2}
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$((TP * DP))" \
    recipes/generate_distributed.py ${MODEL:+--model "$MODEL"} --tp "$TP" --dp "$DP" --eager --chat "$@"
