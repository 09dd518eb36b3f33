"""What `LLM.generate` returns, with vLLM's offline names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestMetrics:
    """Timestamps of one request, in time.monotonic() seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token, or None until the first token exists."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to finish, or None while the request runs."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class Logprob:
    """vLLM's: one token's log probability under the model's raw distribution (before penalties and
    filters), its 1-based rank in that whole distribution, and its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the n sequences generated for a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: its top-k and the sampled one
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop_token_ids entry that ended it (None: EOS, as in vLLM)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (any tier) when first scheduled
    # SamplingParams.prompt_logprobs: per prompt position, the prompt token's entry plus the top-k;
    # the first is None (nothing predicts it). None when not asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
