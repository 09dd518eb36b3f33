"""Run statistics and the summary table printed at the end of `toolkit generate`.

Latencies come from each request's `RequestMetrics`. Arrival is when the CLI handed the request to
the engine, so with a window of thousands of queued requests TTFT includes queueing: it is the
latency a batch job sees, not that of an idle server.
"""

from __future__ import annotations

import time
from array import array

import numpy as np
from rich.console import Console
from rich.table import Table

from toolkit.outputs import RequestOutput

PERCENTILES = (50, 90, 99)


class RunStats:
    def __init__(self, skipped: int = 0, skipped_errors: int = 0):
        self.skipped = skipped  # lines answered by an earlier run of the same output file
        self.skipped_errors = skipped_errors  # how many of those answers are error records
        self.succeeded = 0
        self.errors = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        # array('d'): a million requests cost 8 MB per metric, not a list of Python floats.
        self.ttft = array("d")
        self.tpot = array("d")
        self.spec: dict | None = None  # the engine's speculative-decoding counters (Engine.stats()["spec_decode"])
        self.kv: dict | None = None  # the prefix cache's and KV tiers' counters (kv_summary)
        self.pipeline: list[dict] | None = None  # each pipeline stage's busy/idle time (Engine.pipeline_stats)
        self.handoff: dict | None = None  # disaggregated: the prompts' KV the decode instances received
        self.start = time.monotonic()

    def add_output(self, out: RequestOutput) -> int:
        """Counts one finished request; returns its number of generated tokens."""
        tokens = sum(len(c.token_ids) for c in out.outputs)
        self.succeeded += 1
        self.prompt_tokens += len(out.prompt_token_ids)
        self.output_tokens += tokens
        m = out.metrics
        if m is not None and m.ttft is not None:
            self.ttft.append(m.ttft)
            longest = max((len(c.token_ids) for c in out.outputs), default=0)
            # Time per output token after the first, of the longest of the n sequences (the decode steps).
            if longest > 1 and m.finished_time is not None:
                self.tpot.append((m.finished_time - m.first_token_time) / (longest - 1))
        return tokens

    def add_error(self) -> None:
        self.errors += 1

    @property
    def elapsed(self) -> float:
        return max(time.monotonic() - self.start, 1e-9)

    def as_dict(self) -> dict:
        return {
            "requests": self.succeeded + self.errors,
            "succeeded": self.succeeded,
            "errors": self.errors,
            "skipped": self.skipped,
            "skipped_errors": self.skipped_errors,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "elapsed_s": self.elapsed,
            "requests_per_s": (self.succeeded + self.errors) / self.elapsed,
            "output_tokens_per_s": self.output_tokens / self.elapsed,
            "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / self.elapsed,
            "ttft_s": percentiles(self.ttft),
            "tpot_s": percentiles(self.tpot),
            "spec_decode": self.spec,
            "kv_cache": self.kv,
            "pipeline": self.pipeline,
            "kv_handoff": self.handoff,
        }


def percentiles(values: array) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    got = np.percentile(np.frombuffer(values, dtype=np.float64), PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, got)}


def print_summary(stats: RunStats, console: Console, output: str) -> None:
    s = stats.as_dict()
    table = Table(title="toolkit generate", title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("requests", f"{s['requests']:,} ({s['errors']:,} errors)")
    if s["skipped"]:
        errors = f" ({s['skipped_errors']:,} errors)" if s["skipped_errors"] else ""
        table.add_row("skipped", f"{s['skipped']:,} already in the output{errors}")
    table.add_row("prompt tokens", f"{s['prompt_tokens']:,}")
    table.add_row("output tokens", f"{s['output_tokens']:,}")
    table.add_row("elapsed", f"{s['elapsed_s']:.1f} s")
    table.add_row("throughput", f"{s['requests_per_s']:.2f} req/s, {s['output_tokens_per_s']:.1f} output tok/s, "
                                f"{s['total_tokens_per_s']:.1f} total tok/s")
    table.add_row("TTFT p50/p90/p99", _ms(s["ttft_s"]))
    table.add_row("TPOT p50/p90/p99", _ms(s["tpot_s"]))
    spec = s["spec_decode"]
    if spec is not None and spec["num_draft_tokens"]:
        table.add_row("speculation", f"{100 * spec['acceptance_rate']:.1f}% of {spec['num_draft_tokens']:,} "
                                     "draft tokens accepted")
        table.add_row("acceptance length", f"{spec['mean_acceptance_length']:.2f} mean; per position "
                                           f"{_per_position(spec)}%")
    elif spec is not None:
        table.add_row("speculation", "no drafts proposed")
    if s["kv_cache"] is not None:
        table.add_row("prefix cache", prefix_summary(s["kv_cache"]))
        if s["kv_cache"]["bytes_moved"]:
            table.add_row("KV moved", moved_summary(s["kv_cache"]))
    if s["pipeline"]:
        table.add_row("pipeline idle", pipeline_summary(s["pipeline"]))
    if s["kv_handoff"]:
        table.add_row("KV handoff", handoff_summary(s["kv_handoff"]))
    table.add_row("output", output)
    console.print(table)


def handoff_summary(kv: dict) -> str:
    """The prompts' KV the decode instances received from the prefill instances."""
    mean = 1000 * kv["seconds_total"] / kv["transfers"] if kv["transfers"] else 0.0
    return f"{kv['transfers']:,} prompts, {kv['bytes'] / 2**20:,.1f} MiB received, {mean:.1f} ms each on average"


def combine_handoff(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in ("transfers", "bytes", "seconds_total")}


def pipeline_summary(stages: list[dict]) -> str:
    """Each stage's idle share of its time, over the run and over its decode-only steps."""
    return "; ".join(f"stage {st['stage'] + 1} (layers {st['layers'][0]}-{st['layers'][1] - 1}) "
                     f"{100 * st['idle_fraction']:.0f}% (decode {100 * st['decode_idle_fraction']:.0f}%)"
                     for st in stages)


def summary_line(stats: RunStats, output: str) -> str:
    """The summary in one line, for --quiet runs whose stderr goes to a log."""
    s = stats.as_dict()
    return (f"done: {s['requests']} requests, {s['errors']} errors, {s['skipped']} skipped, "
            f"{s['output_tokens']} output tokens in {s['elapsed_s']:.1f}s "
            f"({s['output_tokens_per_s']:.1f} tok/s)"
            + (f", speculation: {spec_summary(s['spec_decode'])}" if s["spec_decode"] is not None else "")
            + (f", prefix cache: {prefix_summary(s['kv_cache'])}" if s["kv_cache"] is not None else "")
            + (f", pipeline idle: {pipeline_summary(s['pipeline'])}" if s["pipeline"] else "")
            + (f", KV handoff: {handoff_summary(s['kv_handoff'])}" if s["kv_handoff"] else "")
            + f" -> {output}")


def spec_summary(spec: dict) -> str:
    """Acceptance of the drafts: the rate, the mean tokens per verify step and the rate per position."""
    if not spec["num_draft_tokens"]:
        return "no drafts proposed"
    return (f"{100 * spec['acceptance_rate']:.1f}% of {spec['num_draft_tokens']:,} draft tokens accepted, "
            f"mean acceptance length {spec['mean_acceptance_length']:.2f}, per position {_per_position(spec)}%")


def _per_position(spec: dict) -> str:
    """The share of verify steps that accepted the draft at each position, in percent."""
    return "/".join(f"{100 * n / spec['num_drafts']:.0f}" for n in spec["accepted_per_pos"])


def combine_spec(a: dict | None, b: dict | None) -> dict | None:
    """Two replicas' speculative-decoding counters as one."""
    if a is None or b is None:
        return a or b
    drafts, tokens, accepted = (a[k] + b[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    return {"num_drafts": drafts, "num_draft_tokens": tokens, "num_accepted_tokens": accepted,
            "accepted_per_pos": [x + y for x, y in zip(a["accepted_per_pos"], b["accepted_per_pos"])],
            "acceptance_rate": accepted / tokens if tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


def _ms(p: dict) -> str:
    if p["p50"] is None:
        return "-"
    return " / ".join(f"{p[k] * 1e3:.1f}" for k in ("p50", "p90", "p99")) + " ms"


def kv_summary(engine) -> dict | None:
    """The prefix cache's and tiers' counters from Engine.stats(), in tokens and bytes; None when
    prefix caching is off and no tier is configured."""
    stats = engine.stats()
    prefix, tiers = stats["prefix_cache"], stats.get("kv_tiers")
    if not engine.config.enable_prefix_caching and tiers is None:
        return None
    hits = {"device": prefix["device_hits"], **(tiers or {}).get("hit_tokens", {})}
    return {"queries": prefix["queries"], "hits": prefix["hits"], "hits_by_tier": hits,
            "bytes_moved": dict((tiers or {}).get("bytes_moved", {})),
            "failed_loads": (tiers or {}).get("failed_loads", 0)}


def combine_kv(a: dict | None, b: dict | None) -> dict | None:
    """Two replicas' KV counters as one."""
    if a is None or b is None:
        return a or b
    def add(x: dict, y: dict) -> dict:
        return {k: x.get(k, 0) + y.get(k, 0) for k in x.keys() | y.keys()}
    return {"queries": a["queries"] + b["queries"], "hits": a["hits"] + b["hits"],
            "hits_by_tier": add(a["hits_by_tier"], b["hits_by_tier"]),
            "bytes_moved": add(a["bytes_moved"], b["bytes_moved"]), "failed_loads": a["failed_loads"] + b["failed_loads"]}


def prefix_summary(kv: dict) -> str:
    rate = 100 * kv["hits"] / kv["queries"] if kv["queries"] else 0.0
    tiers = ", ".join(f"{tier} {n:,}" for tier, n in kv["hits_by_tier"].items() if n)
    failed = f"; {kv['failed_loads']:,} block loads refused and recomputed" if kv["failed_loads"] else ""
    return f"{kv['hits']:,} of {kv['queries']:,} prompt tokens cached ({rate:.1f}%)" + (f": {tiers}" if tiers else "") + failed


def moved_summary(kv: dict) -> str:
    moved = [(d.replace("_to_", " -> "), n) for d, n in kv["bytes_moved"].items() if n]
    return ", ".join(f"{d} {n / 2**20:,.1f} MiB" for d, n in moved) or "nothing"
