#!/usr/bin/env bash
# Several nodes: one torchrun agent per node, all meeting at one rendezvous endpoint (node 0's
# address). The job's world is NNODES x NPROC_PER_NODE processes = TP x DP.
#
# On real nodes, run on each node (NODE_RANK 0 on the node whose address is the endpoint):
#   NNODES=2 NODE_RANK=0 RDZV_ENDPOINT=10.0.0.1:29531 recipes/run_multinode.sh [driver options]
#   NNODES=2 NODE_RANK=1 RDZV_ENDPOINT=10.0.0.1:29531 recipes/run_multinode.sh [driver options]
# On GPU nodes: NPROC_PER_NODE = GPUs per node, TP = NPROC_PER_NODE (TP inside a node, over
# NVLink) and DP = NNODES; drop --eager; the backend becomes NCCL by itself. Open the endpoint's
# port and the NCCL/gloo ports between the nodes (or set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME).
#
# On this one machine (no NODE_RANK given) it starts both agents itself on 127.0.0.1, each as a
# "node" with one process, tp=2 across them, and waits for both:
#   recipes/run_multinode.sh
# Each line of recipes/example_prompts.txt is a user message through the model's chat template
# (--chat; drop it for a base model without one). Extra options go to recipes/generate_distributed.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NNODES=${NNODES:-2}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
TP=${TP:-$((NNODES * NPROC_PER_NODE))}
DP=${DP:-$((NNODES * NPROC_PER_NODE / TP))}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-127.0.0.1:29531}

node() {  # node() RANK [driver options]: one torchrun agent, the static rendezvous at the endpoint
    local rank=$1; shift
    "$PY" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$rank" --nproc-per-node "$NPROC_PER_NODE" \
        --rdzv-backend static --rdzv-endpoint "$RDZV_ENDPOINT" --max-restarts 0 \
        recipes/generate_distributed.py ${MODEL:+--model "$MODEL"} --tp "$TP" --dp "$DP" --eager --chat "$@"
}

if [[ -n "${NODE_RANK:-}" ]]; then
    node "$NODE_RANK" "$@"
else
    # Loopback demo: every node on this machine; the job fails if either agent fails.
    pids=()
    for ((rank = 1; rank < NNODES; rank++)); do
        node "$rank" "$@" > /dev/null &  # rank 0 prints the outputs
        pids+=($!)
    done
    node 0 "$@"
    for pid in "${pids[@]}"; do wait "$pid"; done
fi
