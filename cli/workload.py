"""The longest request of a `toolkit generate` run, measured before the model loads.

The engine sizes its KV cache for max_num_seqs requests of this length (EngineConfig.max_request_tokens)
instead of max_model_len ones, so a run of short requests on a long-context model does not take
memory it would never use. It costs one pass of the tokenizer over the run's lines (their prompts
are tokenized again as they are sent), the tokenizer alone: no weights are read.
"""

from __future__ import annotations

from collections.abc import Iterable

from toolkit.cli.jobs import Job, parts
from toolkit.tokenizer import render_chat


def longest_request(jobs: Iterable[Job], tokenizer) -> int | None:
    """The most prompt + max_tokens tokens any of the jobs asks for, or None when that is not bounded
    (a request without max_tokens runs to max_model_len). Lines that will fail (unparsable, not
    tokenizable, no tokenizer for a text prompt) ask for nothing: they never reach the KV cache."""
    longest = None
    for job in jobs:
        if job.error is not None:
            continue
        if job.params.max_tokens is None:
            return None
        for part in parts(job):
            prompt = _prompt_tokens(part, tokenizer)
            if prompt is not None:
                longest = max(longest or 0, prompt + job.params.max_tokens)
    return longest


def _prompt_tokens(job: Job, tokenizer) -> int | None:
    if job.prompt_token_ids is not None:
        return len(job.prompt_token_ids)
    if tokenizer is None:
        return None
    try:  # as cli/jobs.py's encode tokenizes
        if job.messages is not None:
            return len(render_chat(tokenizer, job.messages))
        return len(tokenizer(job.prompt)["input_ids"])
    except Exception:  # the line fails when it is sent, with its own error record
        return None
