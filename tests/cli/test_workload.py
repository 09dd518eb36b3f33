"""The longest request a `toolkit generate` input asks for (cli/workload.py), which sizes the KV cache:
against the tokenizer's own counts of each line, computed here."""

from __future__ import annotations

import json

import pytest

from tests.checkpoints import write_checkpoint, write_tokenizer
from toolkit.cli.generate import read_jobs
from toolkit.cli.workload import longest_request
from toolkit.sampling_params import SamplingParams
from toolkit.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(write_tokenizer(write_checkpoint(tmp_path_factory.mktemp("llama"), "llama3")))


def test_longest_request_is_the_longest_prompt_plus_its_max_tokens(tokenizer, tmp_path):
    chat = [{"role": "user", "content": "what is a list comprehension"}]
    lines = [
        {"prompt": "the quick brown fox jumps over the lazy dog", "max_tokens": 5},
        {"prompt": "hi"},  # the run's max_tokens, 20
        {"messages": chat, "max_tokens": 3},
        {"prompt_token_ids": list(range(3, 40)), "max_tokens": 1},
        {"prompt": 7},  # fails to parse: asks for nothing
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    expected = max(len(tokenizer("the quick brown fox jumps over the lazy dog")["input_ids"]) + 5,
                   len(tokenizer("hi")["input_ids"]) + 20,
                   len(tokenizer(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                                 add_special_tokens=False)["input_ids"]) + 3,
                   37 + 1)
    jobs = read_jobs(path, "jsonl", SamplingParams(max_tokens=20), done={})
    assert longest_request(jobs, tokenizer) == expected
    # A data-parallel replica measures only its own share of the lines (here line 4's 37 token ids: line % 2 == 0).
    share = read_jobs(path, "jsonl", SamplingParams(max_tokens=20), done={}, share=(0, 2))
    assert longest_request(share, None) == 38  # without a tokenizer only token ids are measured


def test_a_request_without_max_tokens_leaves_the_length_unbounded(tokenizer, tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("hello\nworld\n")
    assert longest_request(read_jobs(path, "text", SamplingParams(max_tokens=None), done={}), tokenizer) is None
