"""Speculative decoding on a GPU (part of recipes/gpu_check.sh; needs CUDA).

A Llama-3.2-1B-shaped target with seeded random weights, written with save_pretrained, and as its
draft the same model cut to its first 2 layers (embeddings, final norm and head shared): with random
weights the residual stream is mostly the embedding, so the cut model agrees with the full one often,
as a trained small draft would. Checks greedy tokens with speculation (n-gram and the draft model)
against plain greedy decoding, reports acceptance, and batch-1 decode tokens/s with and without.

    python recipes/gpu_spec_check.py --out /tmp/gpu_check/spec.json
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, rms_norm_eps=1e-5,
                tie_word_embeddings=True, rope_theta=500000.0, bos_token_id=1, eos_token_id=2)
DRAFT_LAYERS = 2


# --shape tiny: the same check on a CPU in a minute (to try the script itself where no GPU is lent).
TINY = dict(LLAMA_1B, vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2)


def write_pair(root: Path, shape: dict) -> tuple[Path, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16)
    target.save_pretrained(root / "target", safe_serialization=True)
    draft = LlamaForCausalLM(LlamaConfig(**{**shape, "num_hidden_layers": DRAFT_LAYERS})).to(torch.bfloat16)
    draft.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith("model.layers.") or int(k.split(".")[2]) < DRAFT_LAYERS})
    draft.save_pretrained(root / "draft", safe_serialization=True)
    return root / "target", root / "draft"


def decode(target: Path, spec: dict | None, prompts, new_tokens: int) -> tuple[list, float, dict | None]:
    from toolkit import LLM, SamplingParams

    llm = LLM(str(target), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=1024,
              speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    tokens, seconds = [], 0.0
    for p in prompts:  # batch 1, one request at a time
        sync()
        start = time.perf_counter()
        tokens.append(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
        sync()
        seconds += time.perf_counter() - start
    stats = llm.engine.stats().get("spec_decode")
    return tokens, sum(map(len, tokens)) / seconds, stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/gpu_check/spec.json"))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--shape", choices=("1b", "tiny"), default="1b")
    args = ap.parse_args()
    shape = LLAMA_1B if args.shape == "1b" else TINY
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = write_pair(Path(tmp), shape)
        g = torch.Generator().manual_seed(1)
        base = [torch.randint(10, shape["vocab_size"], (24,), generator=g).tolist() for _ in range(4)]
        prompts = [{"prompt_token_ids": b + b} for b in base]  # each repeats itself: n-gram has matches
        plain, plain_rate, _ = decode(target, None, prompts, args.new_tokens)
        report = {"plain_tokens_per_s": plain_rate}
        for name, spec in (("ngram", {"method": "ngram", "num_speculative_tokens": 4}),
                           ("draft_model", {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4})):
            tokens, rate, stats = decode(target, spec, prompts, args.new_tokens)
            report[name] = {"tokens_identical": tokens == plain, "tokens_per_s": rate, "speedup": rate / plain_rate,
                            "acceptance_rate": stats["acceptance_rate"],
                            "mean_acceptance_length": stats["mean_acceptance_length"],
                            "accepted_per_pos": stats["accepted_per_pos"]}
            print(f"{name}: tokens identical to plain greedy: {tokens == plain}; batch-1 {rate:.1f} tok/s "
                  f"({rate / plain_rate:.2f}x plain {plain_rate:.1f}); acceptance {stats['acceptance_rate']:.1%}, "
                  f"mean length {stats['mean_acceptance_length']:.2f}", flush=True)
            assert tokens == plain, f"{name}: speculative greedy tokens differ from plain greedy"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
