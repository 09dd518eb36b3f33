"""A request's scheduling state: its tokens, how many of them are in the KV cache, and its status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        """The OpenAI/vLLM `finish_reason` string of a status, None while the request is unfinished."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

finish_reason = RequestStatus.finish_reason


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    error: str | None = None
    num_preemptions: int = 0
    # Draft tokens proposed for the next step (speculative decoding): scheduled after the last token,
    # verified by the model, and never part of output_token_ids unless accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    # Prefix caching: a tenant's salt (requests with different salts never share KV), the names of the
    # full blocks so far (scheduling/block_hash.py), and the prompt tokens found cached when the request
    # was first scheduled (-1 until then), vLLM's RequestOutput.num_cached_tokens.
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = -1
    # The engine wants logits at prompt positions too (SamplingParams.prompt_logprobs): such a request
    # reads no cached prefix, whose logits were never computed. The engine clears it once it has them.
    wants_prompt_logits: bool = False

    def __post_init__(self) -> None:
        # Callers naturally pass lists or sets; the scheduler relies on a private, hashable copy.
        # Values are not validated here: a bad request must fail alone (the scheduler rejects it),
        # not raise in the middle of the engine's add_request.
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.stop_token_ids = frozenset(self.stop_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without copying the whole sequence (a decode reads one token)."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def max_num_tokens(self) -> int:
        """The most tokens this request can ever hold (prompt + max_tokens), before max_model_len."""
        return len(self.prompt_token_ids) + self.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
