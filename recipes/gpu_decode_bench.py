"""Decode throughput on a Llama-3-8B-shaped random bf16 model (GPU check; needs CUDA).

Builds only a config.json (weights are seeded random on the GPU: load_format="dummy"), then measures
output tokens/s at batch 1 and 64 for eager, compiled, and compiled + CUDA graphs, and the fraction
of HBM bandwidth reached at batch 1: weight bytes x tokens/s / bandwidth.

    python recipes/gpu_decode_bench.py --hbm-tbps 4.8     # H200: 4.8 TB/s; H100 SXM: 3.35; A100: 2.0
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
    rope_theta=500000.0, torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001,
)
MODES = {"eager": dict(enforce_eager=True), "compiled": dict(cuda_graphs=False), "compiled+cudagraphs": {}}


def run(path: str, mode: str, batch: int, prompt_len: int, new_tokens: int) -> dict:
    from toolkit import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True, max_model_len=1024,
              max_num_seqs=max(batch, 1), attention_backend="triton", **MODES[mode])
    prompts = [{"prompt_token_ids": [(7 * i + j) % 32000 + 10 for j in range(prompt_len)]} for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    del llm
    torch.cuda.empty_cache()
    return dict(mode=mode, batch=batch, tokens_per_s=tokens / seconds, weight_bytes=weight_bytes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hbm-tbps", type=float, default=4.8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp()) / "llama3-8b-shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    rows = []
    for mode in MODES:
        for batch in (1, 64):
            row = run(str(folder), mode, batch, prompt_len=32, new_tokens=args.new_tokens)
            if batch == 1:
                row["hbm_fraction"] = row["weight_bytes"] * row["tokens_per_s"] / (args.hbm_tbps * 1e12)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
