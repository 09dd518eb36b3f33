#!/usr/bin/env bash
# Tensor parallel: one model split over TP processes (q/k/v/gate/up column-wise, o/down row-wise,
# vocab-parallel embedding and lm_head), all on this machine, gloo on CPU.
#
#   recipes/run_tp.sh                       # TP=2, the built-in model, recipes/example_prompts.txt
#   MODEL=PATH TP=2 recipes/run_tp.sh --output out.jsonl
#
# On GPUs: set TP to the number of GPUs to use on the node; the backend becomes NCCL and each
# process takes cuda:LOCAL_RANK by itself. Drop --eager to get the torch.compile'd model (worth it
# there; on this 2-core CPU the compile costs more than the few tokens save).
# Each line of recipes/example_prompts.txt is a user message through the model's chat template
# (--chat; drop it for a base model without one). Extra options go to recipes/generate_distributed.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TP=${TP:-2}
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$TP" \
    recipes/generate_distributed.py ${MODEL:+--model "$MODEL"} --tp "$TP" --eager --chat "$@"
