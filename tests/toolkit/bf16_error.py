"""How far each engine path lands from float32 in bfloat16 and float16, beside transformers.

There is no exact answer in a half dtype; the oracle is the float32 model on the same weights. For one
checkpoint and a few token sequences this measures teacher-forced logits (every position's full-vocab
logits, the sequence fed as given, whatever the model would have sampled) of:

- each engine path (`PATHS`: compiled or eager, each CPU linear and attention choice) in a half dtype,
  against the engine's own float32 logits (eager, which the parity tests hold to transformers' float32);
- transformers in the same half dtype, against transformers in float32.

A path feeds a sequence either as one prefill step (`prefill`) or as a prefill of its first token
followed by one decode step per token (`decode`): the linears see one row per call there, so on CPU
they take the panel kernel where a prefill may take oneDNN.

Used by tests/toolkit/test_bf16_error.py and by hand:

    python -m tests.toolkit.bf16_error CHECKPOINT [--dtype bfloat16] [--path compiled --path eager ...]
        [--feed prefill] [--text "What is the capital of France?" ...]
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass

import torch

from toolkit.scheduling import ScheduledRequest

# Each way the engine can run a step on CPU: compiled or eager; the C++ kernels (attention, and the
# linear with its "auto" choice, or one forced) or torch's own ops ("torch": nn.Linear and the
# reference attention); "flash": every multi-token step's attention in ATen's flash kernel, whatever
# this host's measured choice. Keys are what reports and tests name.
PATHS = {
    "compiled": dict(),
    "compiled-panel": dict(cpu_linear="panel"),
    "compiled-onednn": dict(cpu_linear="onednn"),
    "compiled-nn-linear": dict(cpu_linear="torch"),
    "compiled-torch": dict(cpu_kernels=False),
    "eager": dict(enforce_eager=True),
    "eager-panel": dict(enforce_eager=True, cpu_linear="panel"),
    "eager-onednn": dict(enforce_eager=True, cpu_linear="onednn"),
    "eager-nn-linear": dict(enforce_eager=True, cpu_linear="torch"),
    "eager-torch": dict(enforce_eager=True, cpu_kernels=False),
    "eager-flash": dict(enforce_eager=True, cpu_prefill_attention="flash"),
}
FEEDS = ("prefill", "decode")


@dataclass
class Error:
    """One path's distance from its float32 reference over every position of every sequence."""

    logits: float  # max |logit - reference logit| over positions and the whole vocabulary
    mean_logits: float  # the mean of the same
    logprobs: float  # max |logprob - reference logprob| of the reference's top-5 tokens at each position
    mean_logprobs: float  # the mean of the same
    flips: int  # positions whose argmax differs from the reference's
    positions: int

    def __str__(self) -> str:
        return (f"logits max {self.logits:.4f} mean {self.mean_logits:.4f}  top-5 logprobs max {self.logprobs:.4f} "
                f"mean {self.mean_logprobs:.4f}  argmax flips {self.flips}/{self.positions}")


def error(ours: list[torch.Tensor], reference: list[torch.Tensor], top: int = 5) -> Error:
    """The distance between two lists of [positions, vocab] logits (one entry per sequence)."""
    logit_errs, logprob_errs, flips = [], [], 0
    for a, b in zip(ours, reference):
        a, b = a.float(), b.float()
        logit_errs.append((a - b).abs().flatten())
        idx = b.topk(top, dim=-1).indices
        la, lb = a.log_softmax(-1).gather(1, idx), b.log_softmax(-1).gather(1, idx)
        logprob_errs.append((la - lb).abs().flatten())
        flips += int((a.argmax(-1) != b.argmax(-1)).sum())
    logit_err, logprob_err = torch.cat(logit_errs), torch.cat(logprob_errs)
    return Error(logit_err.max().item(), logit_err.mean().item(), logprob_err.max().item(), logprob_err.mean().item(),
                 flips, sum(a.shape[0] for a in ours))


def available_paths() -> list[str]:
    """The paths this machine can run: oneDNN is forced only where it has native units for bf16."""
    from toolkit.backends.cpu.linear import onednn_native

    return [p for p in PATHS if "onednn" not in p or onednn_native(torch.bfloat16)]


def make_llm(path, engine_path: str, dtype: str, max_model_len: int = 256, **kwargs):
    from toolkit import LLM

    return LLM(str(path), dtype=dtype, max_model_len=max_model_len, block_size=16, kv_cache_memory_bytes=64 << 20,
               **PATHS[engine_path], **kwargs)


def engine_logits(runner, sequences: list[list[int]], feed: str = "prefill") -> list[torch.Tensor]:
    """Teacher-forced float32 logits [len(seq), V] of each sequence through the engine's runner."""
    return [_feed(runner, seq, feed).float().cpu() for seq in sequences]


def _feed(runner, seq: list[int], feed: str) -> torch.Tensor:
    blocks = list(range((len(seq) + runner.config.block_size - 1) // runner.config.block_size))
    if blocks and blocks[-1] >= runner.kv_spec.num_blocks:
        raise ValueError(f"a sequence of {len(seq)} tokens needs more than the {runner.kv_spec.num_blocks} KV blocks")
    first = len(seq) if feed == "prefill" else 1
    # Every position's logits as a prompt-logprobs request asks for them: the sampled row (the last
    # position) first, then the prompt's. The runner marks these inputs dynamic, as it marks a served
    # step's, so one compiled graph serves every length.
    out = runner.execute(runner.prepare([ScheduledRequest("teacher", seq[:first], 0, blocks, True,
                                                          num_prompt_logits=first - 1)]))
    rows = [out[1:], out[:1]]
    for pos in range(first, len(seq)):
        rows.append(runner.execute(runner.prepare([ScheduledRequest("teacher", [seq[pos]], pos, blocks, True)])))
    return torch.cat(rows)


def hf_logits(path, sequences: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """transformers' logits of each sequence, one forward each, as float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return [model(torch.tensor([seq])).logits[0].float() for seq in sequences]


def measure(path, sequences: list[list[int]], engine_paths: list[str], dtypes=("bfloat16",),
            feeds=("prefill",)) -> dict:
    """{(dtype, name, feed): Error} for each engine path and feed, and {(dtype, "transformers", "-"): Error}."""
    reference = engine_logits(make_llm(path, "eager", "float32").engine.runner, sequences)
    hf_reference = hf_logits(path, sequences, torch.float32)
    results = {}
    for dtype in dtypes:
        results[(dtype, "transformers", "-")] = error(hf_logits(path, sequences, getattr(torch, dtype)), hf_reference)
        for name in engine_paths:
            runner = make_llm(path, name, dtype).engine.runner
            for feed in feeds:
                results[(dtype, name, feed)] = error(engine_logits(runner, sequences, feed), reference)
            del runner
            gc.collect()
    return results


def chat_sequences(path, texts: list[str], continuation_tokens: int = 24) -> list[list[int]]:
    """Each text as a one-turn chat prompt followed by the float32 model's greedy answer (eager engine),
    so the teacher-forced positions are the ones a user's answer goes through."""
    from toolkit import LLM, SamplingParams
    from toolkit.tokenizer import render_chat

    llm = LLM(str(path), dtype="float32", max_model_len=256, enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    prompts = [render_chat(llm.get_tokenizer(), [{"role": "user", "content": t}]) for t in texts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=continuation_tokens), use_tqdm=False)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


STANDARD_QUESTIONS = [
    "What is the capital of France?",
    "What is a list comprehension in Python?",
    "Name three primary colors.",
    "How many days are in a leap year?",
    "Who wrote Romeo and Juliet?",
    "What does a CPU do?",
]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--dtype", action="append", choices=["bfloat16", "float16"])
    parser.add_argument("--path", action="append", choices=list(PATHS))
    parser.add_argument("--feed", action="append", choices=FEEDS)
    parser.add_argument("--text", action="append", help="a user question (default: a few standard ones)")
    parser.add_argument("--tokens", type=int, default=24, help="greedy float32 answer tokens fed after each prompt")
    args = parser.parse_args(argv)
    sequences = chat_sequences(args.checkpoint, args.text or STANDARD_QUESTIONS, args.tokens)
    results = measure(args.checkpoint, sequences, args.path or available_paths(), args.dtype or ["bfloat16"],
                      args.feed or ["prefill"])
    for (dtype, name, feed), err in results.items():
        print(f"{dtype:9} {name:20} {feed:8} {err}")


if __name__ == "__main__":
    main()
