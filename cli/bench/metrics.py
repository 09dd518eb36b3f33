"""Benchmark metrics, defined as vLLM's `vllm bench serve` defines them, from per-request token times.

Every system (ours, transformers, vLLM) is measured the same way from the outside: a request's
arrival is the moment it was handed to the system, and each time the system hands back new tokens
of the request (after an engine step, or a streamer callback) is one *chunk* with its time and its
token count. From those:

- TTFT  = first chunk time - arrival
- E2EL  = last chunk time - arrival
- TPOT  = (E2EL - TTFT) / (output tokens - 1): the first token excluded; only requests with more
          than one output token have one (vLLM's rule)
- ITL   = the gaps between successive chunks of a request, all requests' gaps pooled into one list
          (vLLM records one gap per streamed chunk; here one chunk is one engine step)

Each is summarized by mean, median and P99 with numpy's default (linear) interpolation, in
milliseconds, like vLLM's report. An empty list summarizes to zeros, as vLLM prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (99,)


@dataclass
class RequestTiming:
    """One request as seen from outside the system: when it arrived and when its tokens came back."""

    arrival: float
    prompt_len: int
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, new tokens) in time order

    def add(self, when: float, new_tokens: int) -> None:
        if new_tokens > 0:
            self.chunks.append((when, new_tokens))

    @property
    def output_len(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.arrival

    @property
    def e2el(self) -> float:
        return self.chunks[-1][0] - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a one-token request."""
        n = self.output_len
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        times = [t for t, _ in self.chunks]
        return [b - a for a, b in zip(times, times[1:])]

    def to_json(self) -> dict:
        return {"arrival": self.arrival, "prompt_len": self.prompt_len, "chunks": [list(c) for c in self.chunks]}

    @classmethod
    def from_json(cls, d: dict) -> "RequestTiming":
        return cls(d["arrival"], d["prompt_len"], [(float(t), int(n)) for t, n in d["chunks"]])


def summarize(values_s: list[float], percentiles=PERCENTILES) -> dict[str, float]:
    """mean / median / pXX of a list of seconds, in milliseconds (zeros for an empty list)."""
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    empty = arr.size == 0
    out = {"mean": 0.0 if empty else float(arr.mean()), "median": 0.0 if empty else float(np.median(arr))}
    for p in percentiles:
        out[f"p{p:g}"] = 0.0 if empty else float(np.percentile(arr, p))
    return out


def latency_metrics(timings: list[RequestTiming], duration_s: float, percentiles=PERCENTILES) -> dict:
    """TTFT / TPOT / ITL / E2EL summaries (ms) and the run's throughput, over requests with output."""
    done = [t for t in timings if t.chunks]
    tpots = [t.tpot for t in done if t.tpot is not None]
    itls = [gap for t in done for gap in t.itls]
    out_tokens = sum(t.output_len for t in done)
    in_tokens = sum(t.prompt_len for t in done)
    return {
        "completed": len(done),
        "duration_s": duration_s,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "requests_per_s": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_tokens_per_s": out_tokens / duration_s if duration_s > 0 else 0.0,
        "total_tokens_per_s": (in_tokens + out_tokens) / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": summarize([t.ttft for t in done], percentiles),
        "tpot_ms": summarize(tpots, percentiles),
        "itl_ms": summarize(itls, percentiles),
        "e2el_ms": summarize([t.e2el for t in done], percentiles),
    }


def throughput_metrics(num_requests: int, prompt_tokens: int, output_tokens: int, elapsed_s: float) -> dict:
    """vLLM `bench throughput`'s three figures; output_tokens counts only tokens each request asked for."""
    return {
        "num_requests": num_requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed_s,
        "requests_per_s": num_requests / elapsed_s,
        "output_tokens_per_s": output_tokens / elapsed_s,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed_s,
    }


def decode_metrics(timing: RequestTiming | list[RequestTiming]) -> dict:
    """A batch-1 decode run: tokens/s after the first token (1 / TPOT).

    Several runs of the same request count as one: their decode tokens over their decode time, and
    the mean TTFT.
    """
    runs = timing if isinstance(timing, list) else [timing]
    tokens = sum(t.output_len - 1 for t in runs if t.output_len > 1)
    seconds = sum(t.e2el - t.ttft for t in runs if t.output_len > 1)
    tpot = seconds / tokens if tokens and seconds > 0 else None
    out = {
        "prompt_len": runs[0].prompt_len,
        "output_tokens": runs[0].output_len,
        "ttft_ms": 1000.0 * sum(t.ttft for t in runs) / len(runs),
        "tpot_ms": (tpot or 0.0) * 1000.0,
        "decode_tokens_per_s": 1.0 / tpot if tpot else 0.0,
    }
    if len(runs) > 1:
        out["runs_decode_tokens_per_s"] = [1.0 / t.tpot if t.tpot else 0.0 for t in runs]
    return out


def combine_throughput(runs: list[dict]) -> dict:
    """Timed runs of one workload reported as one: the rates are total tokens over total time, the
    counts and the elapsed time are per run (their mean). Each run's figures stay under "runs", so a
    drift between them is visible."""
    def total(key):
        return sum(r[key] for r in runs)

    out = throughput_metrics(total("num_requests"), total("prompt_tokens"), total("output_tokens"), total("elapsed_s"))
    for key in ("num_requests", "prompt_tokens", "output_tokens", "elapsed_s"):
        mean = total(key) / len(runs)
        out[key] = int(mean) if key != "elapsed_s" and mean == int(mean) else mean
    if any("compile_in_run_s" in r for r in runs):
        out["compile_in_run_s"] = sum(r.get("compile_in_run_s", 0.0) for r in runs)
    out["runs"] = runs
    return out


def spec_delta(after: dict, before: dict, sign: int = 1) -> dict:
    """Speculative-decoding counters of one run: `after - before` (sign=-1: after + before, two runs as one),
    with its acceptance rate (%), mean acceptance length and per-position acceptance (%) recomputed."""
    counts = {k: after[k] - sign * before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    per_pos = [a - sign * b for a, b in zip(after["accepted_per_pos"], before["accepted_per_pos"])]
    drafts, tokens = counts["num_drafts"], counts["num_draft_tokens"]
    return {**counts, "accepted_per_pos": per_pos,
            "acceptance_rate_pct": 100 * counts["num_accepted_tokens"] / tokens if tokens else None,
            "mean_acceptance_length": 1 + counts["num_accepted_tokens"] / drafts if drafts else None,
            "acceptance_per_pos_pct": [100 * n / drafts for n in per_pos] if drafts else None}


KV_COUNTERS = ("queries", "hits", "device_hits", "cpu_hits", "disk_hits", "device_to_cpu_bytes", "cpu_to_device_bytes",
               "device_to_disk_bytes", "disk_to_device_bytes")


def kv_delta(after: dict, before: dict, sign: int = 1) -> dict:
    """Prefix-cache and tier counters of one run (`after - before`; sign=-1 adds two runs), with the hit
    rate and each tier's share of the queried tokens (%) and the bytes moved (MiB) derived."""
    counts = {k: after.get(k, 0) - sign * before.get(k, 0) for k in KV_COUNTERS}
    q = counts["queries"]
    out = dict(counts, hit_rate_pct=100 * counts["hits"] / q if q else None)
    for tier in ("device", "cpu", "disk"):
        out[f"{tier}_hit_pct"] = 100 * counts[f"{tier}_hits"] / q if q else None
    for direction in ("device_to_cpu", "cpu_to_device", "device_to_disk", "disk_to_device"):
        out[f"{direction}_mib"] = counts[f"{direction}_bytes"] / 2**20
    return out


def expert_delta(after: dict, before: dict, sign: int = 1) -> dict:
    """Tokens routed to each expert of each MoE layer during one run (`after - before`; sign=-1 adds two
    runs), with the imbalance a user looks for: per layer the busiest expert's load over the mean
    (1.0 = even; top_k x experts would be every token on one expert), worst and mean over layers."""
    loads = [[a - sign * b for a, b in zip(la, lb)] for la, lb in zip(after["tokens"], before["tokens"])]
    ratios = [max(layer) * len(layer) / sum(layer) for layer in loads if sum(layer)]
    return {"tokens": loads, "routed_pairs": sum(map(sum, loads)),
            "max_over_mean_worst": max(ratios) if ratios else None,
            "max_over_mean_mean": sum(ratios) / len(ratios) if ratios else None}
