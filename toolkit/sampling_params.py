"""Per-request sampling settings, with vLLM's offline names and defaults.

Validation happens once, here, so the sampler and the detokenizer can trust every field:
an invalid value raises ValueError naming the field and the allowed range.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# Temperatures below this are treated as greedy: dividing logits by a near-zero temperature
# overflows float32 to inf and the softmax turns into NaN (vLLM uses the same threshold).
_GREEDY_TEMPERATURE_EPS = 1e-5


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1  # drawn from the engine-wide generator
    RANDOM_SEED = 2  # drawn from the request's own generator


def _is_int(value) -> bool:
    # bool is a subclass of int, but `top_k=True` is a bug, not a value.
    return isinstance(value, int) and not isinstance(value, bool)


NUMBER_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # per prompt token: its logprob and the top-k (RequestOutput.prompt_logprobs)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    # vLLM's logits processors, applied to the raw logits before penalties and sampling (toolkit/sampler.py).
    logit_bias: dict[int, float] | None = None  # added to the token's logit (JSON's string keys are taken)
    allowed_token_ids: list[int] | None = None  # every other token is masked out

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (raises ValueError naming it). Run at construction and again when a request
        is added, so a field changed after construction (`sp.n = 0`) is caught before it runs."""
        self._normalize()
        self._validate_counts()
        self._validate_distribution()
        self._validate_penalties()
        self._validate_stops()
        self._validate_logits_processors()

    def _normalize(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop).__name__} {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ValueError(f"stop_token_ids must be a list of ints, got {type(self.stop_token_ids).__name__} "
                             f"{self.stop_token_ids!r}")
        # 5.0 tokens is 5 (OpenAI and vLLM take it); 5.5 is an error below.
        for name in ("n", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                setattr(self, name, int(value))
        for name in NUMBER_FIELDS:
            value = getattr(self, name)
            if not _is_number(value):
                raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        # -1 and 0 both mean "no top-k"; keep one spelling so consumers test a single value.
        if self.top_k == -1:
            self.top_k = 0

    def _validate_counts(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n must be an int >= 1", self.n)
        if self.max_tokens is not None:
            _require(_is_int(self.max_tokens) and self.max_tokens >= 1,
                     "max_tokens must be None or an int >= 1", self.max_tokens)
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0,
                 "min_tokens must be an int >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require(_is_int(value) and value >= 0, f"{name} must be None or an int >= 0", value)
        if self.seed is not None:
            # torch.Generator's range; larger ints would alias others in their low 64 bits.
            _require(_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX,
                     f"seed must be None or an int in [{SEED_MIN}, {SEED_MAX}]", self.seed)

    def _validate_distribution(self) -> None:
        _require(_is_number(self.temperature) and self.temperature >= 0,
                 "temperature must be >= 0", self.temperature)
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1,
                 "top_p must be in (0, 1]", self.top_p)
        _require(_is_int(self.top_k) and self.top_k >= 0,
                 "top_k must be 0 or -1 (disabled) or an int >= 1", self.top_k)
        _require(_is_number(self.min_p) and 0 <= self.min_p <= 1,
                 "min_p must be in [0, 1]", self.min_p)

    def _validate_penalties(self) -> None:
        _require(_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
                 "repetition_penalty must be > 0", self.repetition_penalty)
        _require(_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                 "presence_penalty must be in [-2, 2]", self.presence_penalty)
        _require(_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                 "frequency_penalty must be in [-2, 2]", self.frequency_penalty)

    def _validate_stops(self) -> None:
        for s in self.stop:
            # An empty stop string would match everywhere and end every request at once.
            _require(isinstance(s, str) and s != "", "stop must hold non-empty strings", s)
        for t in self.stop_token_ids:
            _require(_is_int(t) and t >= 0, "stop_token_ids must hold ints >= 0", t)

    def _validate_logits_processors(self) -> None:
        if self.logit_bias is not None:
            _require(isinstance(self.logit_bias, dict), "logit_bias must be a dict of token id -> bias",
                     self.logit_bias)
            self.logit_bias = {_token_key(k): _bias_value(k, v) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            _require(isinstance(ids, (list, tuple)) and len(ids) > 0,
                     "allowed_token_ids must be None or a non-empty list of ints", ids)
            for t in ids:
                _require(_is_int(t) and t >= 0, "allowed_token_ids must hold ints >= 0", t)
            self.allowed_token_ids = list(ids)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in logit_bias and allowed_token_ids must exist; only the engine knows the vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = sorted({t for t in ids if t >= vocab_size})
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def child_seed(seed: int, index: int) -> int:
    """The seed of sequence `index` of an n > 1 request: seed + index, wrapped into the seed range."""
    return (seed + index - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN


def _token_key(key) -> int:
    # OpenAI's logit_bias is a JSON object, whose keys are strings: "50256" names token 50256.
    if isinstance(key, str) and key.strip().lstrip("-").isdecimal():
        key = int(key)
    _require(_is_int(key) and key >= 0, "logit_bias keys must be token ids (ints >= 0)", key)
    return key


def _bias_value(key: int, value) -> float:
    # An infinite or NaN bias would turn the whole row's softmax into NaN; -100 already bans a token.
    _require(_is_number(value) and math.isfinite(value), f"logit_bias[{key!r}] must be a finite number", value)
    return float(value)


def _require(ok: bool, message: str, value) -> None:
    if not ok:
        raise ValueError(f"{message}, got {value!r}")
