"""`speculative_config`: vLLM's dict, parsed and checked once (`SpeculativeConfig.parse`).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "path/to/draft", "num_speculative_tokens": 4}

`disable_by_batch_size: N` (either method) proposes nothing for a step with more than N running
requests: at high concurrency the batch already keeps the device busy and verifying drafts only adds
work. Every error names the field it is about.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, fields
from pathlib import Path

METHODS = ("ngram", "draft_model")


class SpeculativeConfigError(ValueError):
    """A speculative_config that cannot run; the message names the field."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value, default_draft: str | Path | None = None) -> "SpeculativeConfig | None":
        """From a dict, a JSON string or a SpeculativeConfig (None stays None). `default_draft` is the
        draft a draft_model config without "model" gets (the CLI's built-in pair), else it is an error."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise SpeculativeConfigError(f"speculative_config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError(f"speculative_config must be a dict (or its JSON), got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(f"speculative_config has unknown field(s) {', '.join(map(repr, unknown))}; "
                                         f"known fields: {', '.join(sorted(known))}")
        value = dict(value)
        if value.get("method") == "draft_model" and value.get("model") is None and default_draft is not None:
            value["model"] = str(default_draft)
        if "method" not in value or "num_speculative_tokens" not in value:
            missing = [name for name in ("method", "num_speculative_tokens") if name not in value]
            raise SpeculativeConfigError(f"speculative_config needs {' and '.join(map(repr, missing))}")
        return cls(**value)

    def __post_init__(self):
        if self.method not in METHODS:
            raise SpeculativeConfigError(f"speculative_config.method must be one of {', '.join(METHODS)}, "
                                         f"got {self.method!r}")
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.disable_by_batch_size is not None:
            _positive_int("disable_by_batch_size", self.disable_by_batch_size)
        if self.method == "ngram":
            _positive_int("prompt_lookup_min", self.prompt_lookup_min)
            _positive_int("prompt_lookup_max", self.prompt_lookup_max)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise SpeculativeConfigError(
                    f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                    f"({self.prompt_lookup_max})")
            if self.model is not None:
                raise SpeculativeConfigError("speculative_config.model is for method 'draft_model', not 'ngram'")
        else:
            if self.model is None:
                raise SpeculativeConfigError("speculative_config.model is required for method 'draft_model': "
                                             "a Hugging Face folder sharing the target's vocabulary")
            path = Path(self.model)
            if not (path / "config.json").is_file():
                what = "does not exist" if not path.exists() else "has no config.json"
                raise SpeculativeConfigError(f"speculative_config.model: {path} {what}; expected a Hugging Face "
                                             "model folder")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    def check_draft_vocabulary(self, draft_vocab_size: int, target_vocab_size: int) -> None:
        if draft_vocab_size != target_vocab_size:
            raise SpeculativeConfigError(
                f"speculative_config.model: the draft's vocabulary ({draft_vocab_size} tokens, {self.model}) differs "
                f"from the target's ({target_vocab_size}); a draft must share the target's tokenizer")


def _positive_int(name: str, value) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise SpeculativeConfigError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
