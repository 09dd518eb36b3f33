"""`toolkit bench serve`'s workload schedule and statistics (cli/bench/serving.py), without a server."""

from __future__ import annotations

import math

import numpy as np
import pytest

from toolkit.cli.bench.metrics import RequestTiming
from toolkit.cli.bench.serving import parse_goodput, poisson_arrivals, serving_metrics


def test_poisson_arrivals_are_seeded_with_exponential_gaps_at_the_rate():
    rate, n = 4.0, 20_000
    times = poisson_arrivals(n, rate, seed=1)
    assert times == poisson_arrivals(n, rate, seed=1) and times != poisson_arrivals(n, rate, seed=2)
    assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # an exponential's coefficient of variation
    assert poisson_arrivals(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError, match="must be > 0"):
        poisson_arrivals(5, 0)


def test_goodput_slos_parse_to_seconds_and_refuse_nonsense():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000"]) == {"ttft": 0.5, "tpot": 0.05, "e2el": 2.0}
    assert parse_goodput(None) == {}
    for bad in ("ttft", "ttft:-1", "itl:5", "tpot:fast"):
        with pytest.raises(ValueError, match="KEY:MS"):
            parse_goodput([bad])


def test_serving_metrics_from_chunk_times():
    fast = RequestTiming(0.0, 10, [(0.1, 1), (0.2, 1), (0.3, 1)])  # TTFT 0.1, TPOT 0.1, E2E 0.3
    slow = RequestTiming(1.0, 20, [(1.5, 1), (2.5, 2)])  # TTFT 0.5, TPOT (1.5 - 0.5) / 2, E2E 1.5
    failed = RequestTiming(0.0, 5)
    out = serving_metrics([fast, slow, failed], duration_s=4.0, slo={"ttft": 0.2})
    assert out["completed"] == 2 and out["failed"] == 1 and out["output_tokens"] == 6
    assert out["output_tokens_per_s"] == 6 / 4.0 and out["requests_per_s"] == 2 / 4.0
    assert out["ttft_ms"]["p50"] == pytest.approx(1000 * (0.1 + 0.5) / 2)
    assert out["tpot_ms"]["p99"] == pytest.approx(1000 * (0.1 + 0.99 * (0.5 - 0.1)))  # numpy's linear interpolation
    assert out["itl_ms"]["mean"] == pytest.approx(1000 * (0.1 + 0.1 + 1.0) / 3)
    assert out["e2el_ms"]["median"] == out["e2el_ms"]["p50"] == pytest.approx(1000 * (0.3 + 1.5) / 2)
    assert out["good_requests"] == 1 and out["goodput_requests_per_s"] == 1 / 4.0
    assert serving_metrics([fast, slow], 4.0, {"ttft": 0.6, "tpot": 0.5})["good_requests"] == 2
    assert serving_metrics([fast, slow], 4.0, {"e2el": 1.0})["good_requests"] == 1
