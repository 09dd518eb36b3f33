"""What `LLM.get_metrics()` returns: vLLM's metric reader types (`vllm.v1.metrics.reader`), with the
toolkit's names under a `toolkit:` prefix (vLLM's `vllm:` names otherwise)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    values: list[int] = field(default_factory=list)
