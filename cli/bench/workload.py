"""Benchmark workloads: seeded random token prompts, or a JSONL dataset; always token ids in the end.

Every system gets the same token-id prompts and the same output length per request, generated
greedily with EOS ignored, so each request produces exactly `output_len` tokens everywhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import numpy as np

# Token ids below this are left out of random prompts: pad/bos/eos and other specials live there.
FIRST_RANDOM_ID = 3


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def random_workload(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompt and output lengths uniform in the inclusive ranges, token ids uniform in the vocabulary."""
    for name, (lo, hi) in (("input_len", input_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} range must satisfy 1 <= min <= max, got {lo}..{hi}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if vocab_size <= FIRST_RANDOM_ID:
        raise ValueError(f"vocab_size {vocab_size} is too small for random prompts")
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(input_len[0], input_len[1] + 1, num_requests)
    output_lens = rng.integers(output_len[0], output_len[1] + 1, num_requests)
    return [
        BenchRequest(rng.integers(FIRST_RANDOM_ID, vocab_size, int(p)).tolist(), int(o))
        for p, o in zip(prompt_lens, output_lens)
    ]


def prefix_repetition_workload(num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int,
                               num_requests: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """vLLM's prefix_repetition shape: num_prefixes random prefixes shared evenly by the requests, each
    with its own random suffix, in a shuffled order."""
    for name, value in (("num_prefixes", num_prefixes), ("prefix_len", prefix_len), ("suffix_len", suffix_len),
                        ("output_len", output_len), ("num_requests", num_requests)):
        if value < (0 if name == "suffix_len" else 1):
            raise ValueError(f"prefix repetition: {name} must be >= 1, got {value}")
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(FIRST_RANDOM_ID, vocab_size, prefix_len).tolist() for _ in range(num_prefixes)]
    requests = [BenchRequest(prefixes[i % num_prefixes] + rng.integers(FIRST_RANDOM_ID, vocab_size, suffix_len).tolist(),
                             output_len) for i in range(num_requests)]
    return [requests[i] for i in rng.permutation(num_requests)]


def multi_turn_workload(conversations: int, turns: int, user_len: int, reply_len: int, vocab_size: int,
                        seed: int = 0) -> list[BenchRequest]:
    """Conversations of `turns` turns: turn t's prompt is the conversation so far (user messages and
    replies, random tokens fixed by the seed: the replies are not the ones generated) plus a new user
    message, and asks for a reply_len-token reply. Turn-major order: every conversation's turn 1,
    then every turn 2, ..., so a conversation's earlier KV must survive the others' in between."""
    for name, value in (("conversations", conversations), ("turns", turns), ("user_len", user_len),
                        ("reply_len", reply_len)):
        if value < 1:
            raise ValueError(f"multi-turn: {name} must be >= 1, got {value}")
    rng = np.random.default_rng(seed)
    history = [[] for _ in range(conversations)]
    requests = []
    for _turn in range(turns):
        for c in range(conversations):
            history[c] = history[c] + rng.integers(FIRST_RANDOM_ID, vocab_size, user_len).tolist()
            requests.append(BenchRequest(list(history[c]), reply_len))
            history[c] = history[c] + rng.integers(FIRST_RANDOM_ID, vocab_size, reply_len).tolist()
    return requests


def working_set_tokens(requests: list[BenchRequest]) -> int:
    """Distinct prompt tokens, counted as a trie of the prompts: the KV a perfect prefix cache keeps."""
    trie: dict = {}
    count = 0
    for r in requests:
        node = trie
        for t in r.prompt_token_ids:
            if t not in node:
                node[t] = {}
                count += 1
            node = node[t]
    return count


def load_dataset(
    path: Path,
    tokenize: Callable[[str], list[int]] | None,
    default_output_len: int,
    num_requests: int | None = None,
) -> list[BenchRequest]:
    """One request per JSONL line: `prompt` (text, needs a tokenizer) or `prompt_token_ids`, and `max_tokens`."""
    requests = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: expected an object")
        if "prompt_token_ids" in record:
            ids = [int(t) for t in record["prompt_token_ids"]]
        elif "prompt" in record:
            if tokenize is None:
                raise ValueError(f"{path}:{lineno}: a text prompt needs the model's tokenizer, and the model has none")
            ids = tokenize(str(record["prompt"]))
        else:
            raise ValueError(f"{path}:{lineno}: needs 'prompt' or 'prompt_token_ids'")
        if not ids:
            raise ValueError(f"{path}:{lineno}: the prompt is empty")
        out = int(record.get("max_tokens", default_output_len))
        if out < 1:
            raise ValueError(f"{path}:{lineno}: max_tokens must be >= 1, got {out}")
        requests.append(BenchRequest(ids, out))
        if num_requests is not None and len(requests) == num_requests:
            break
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def workload_summary(requests: list[BenchRequest]) -> dict:
    p = [r.prompt_len for r in requests]
    o = [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(p),
        "output_tokens": sum(o),
        "prompt_len": {"min": min(p), "mean": sum(p) / len(p), "max": max(p)},
        "output_len": {"min": min(o), "mean": sum(o) / len(o), "max": max(o)},
        "distinct_prompt_tokens": working_set_tokens(requests),
    }


def hf_batches(requests: list[BenchRequest], batch_size: int) -> list[list[int]]:
    """Static batches for transformers: request indices sorted by (output_len, prompt_len), then cut.

    Sorting by output length first keeps the decode tokens wasted on a batch's shorter requests low
    (decode dominates); prompt length second keeps left padding low inside a batch.
    """
    order = sorted(range(len(requests)), key=lambda i: (requests[i].output_len, requests[i].prompt_len))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
