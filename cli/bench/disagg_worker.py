"""The program `toolkit bench disagg` (cli/bench/disaggregated.py) runs under torch.distributed.run: every
rank builds our engine with the spec's EngineConfig fields (a disaggregated layout, or colocated
data-parallel replicas), warms it up, then feeds the timed workload at its arrival times and steps
until done. Disaggregated, every rank is fed every request (the engine routes it); colocated, each
replica its token-balanced share (as LLM.generate splits). The ranks that return a request's output
time it as vLLM's bench serve does (RequestTiming: arrival, then each step's new tokens); rank 0
gathers every rank's timings and role counters and prints them as a JSON "result" event."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

__test__ = False


def main(spec_path: str) -> None:
    from toolkit import LLM
    from toolkit.cli.bench.metrics import RequestTiming, latency_metrics
    from toolkit.parallel import shutdown

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    rank = int(os.environ.get("RANK", "0"))
    emit = (lambda event: print(json.dumps(event), flush=True)) if rank == 0 else (lambda event: None)
    start = time.perf_counter()
    llm = LLM(spec["model"], **spec["engine_args"])
    engine = llm.engine
    requests = spec["requests"]
    mine = _share(engine, requests)
    # Every graph compiles outside the timed run: the warm requests once per rank reach every instance.
    warm = list(spec["warm"]) * dist.get_world_size()
    _run(engine, warm, _share(engine, warm), "warm", None)
    engine.front.reset_times()
    startup_s = time.perf_counter() - start
    # Rank 0's bar: its replica's share, or (a prefill rank) the prompts its instance hands over.
    emit({"event": "phase", "name": "timed run (rank 0's part)", "total": len(mine) if engine.front.progress else 0})
    stats_before = _role_stats(engine)
    tokens: dict[str, list[int]] = {}
    timings, elapsed = _run(engine, requests, list(mine), "r", lambda n: emit({"event": "advance", "n": n}), tokens)
    parts = [None] * dist.get_world_size() if rank == 0 else None
    mine_out = {"timings": [(t.arrival, t.prompt_len, t.chunks) for t in timings], "elapsed_s": elapsed,
                "role": _delta(stats_before, _role_stats(engine)), "tokens": tokens}
    dist.gather_object(mine_out, parts, dst=0)
    if rank == 0:
        everything = [RequestTiming(a, p, [tuple(c) for c in chunks]) for part in parts for a, p, chunks in part["timings"]]
        duration = max(part["elapsed_s"] for part in parts)
        outputs = {rid: t for part in parts for rid, t in part["tokens"].items()}
        emit({"event": "result", "result": {"startup_s": startup_s, "latency": latency_metrics(everything, duration),
                                            "timings": [t.to_json() for t in everything],
                                            "roles": [part["role"] for part in parts],
                                            "tokens": [outputs.get(f"r{i}") for i in range(len(requests))]}})
    shutdown()


def _share(engine, requests: list[dict]) -> list[int]:
    """The requests this rank is fed, as LLM.generate feeds them (toolkit/front_end.py): colocated
    replicas their token-balanced share, a disaggregated job every request (the roles route)."""
    return engine.front.share([len(r["prompt_token_ids"]) + r["output_len"] for r in requests])


def _run(engine, requests: list[dict], mine: list[int], prefix: str, advance, tokens: dict | None = None,
         ) -> tuple[list, float]:
    """Feed `mine` of the requests at their arrival times (seconds after the start) and step until
    every rank's share is done; returns (this rank's timings of the requests it serves, elapsed), and
    puts the token ids of those it finished in `tokens`."""
    from toolkit import SamplingParams
    from toolkit.cli.bench.metrics import RequestTiming

    dist.barrier()
    t0 = time.monotonic()
    queue = sorted(mine, key=lambda i: requests[i]["arrival_s"])
    served: dict[str, RequestTiming] = {}
    live: set[str] = set()
    while queue or engine.has_unfinished():
        now = time.monotonic()
        while queue and requests[queue[0]]["arrival_s"] <= now - t0:
            i = queue.pop(0)
            r, rid = requests[i], f"{prefix}{i}"
            params = SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True)
            engine.add_request(rid, r["prompt_token_ids"], params, arrival_time=t0 + r["arrival_s"])
            if engine.serves(rid):
                served[rid] = RequestTiming(t0 + r["arrival_s"], len(r["prompt_token_ids"]))
                live.add(rid)
        if not engine.has_unfinished():
            if not queue:
                break
            time.sleep(min(0.005, max(0.0, requests[queue[0]]["arrival_s"] - (time.monotonic() - t0))))
            continue
        handed = engine.front.handed_over
        finished = {out.request_id: out for out in engine.step()}
        if advance is not None and engine.front.handed_over > handed:
            advance(engine.front.handed_over - handed)
        now = time.monotonic()
        for rid in list(live):
            timing = served[rid]
            if rid in finished:
                count = len(finished[rid].outputs[0].token_ids)
                live.discard(rid)
                if tokens is not None:
                    tokens[rid] = finished[rid].outputs[0].token_ids
                if advance is not None:
                    advance(1)
            else:
                try:
                    count = engine.request_output_len(rid)
                except KeyError:  # not in this engine's scheduler yet (its prefill is elsewhere)
                    count = 0
            timing.add(now, count - timing.output_len)
    engine.front.finish(engine)
    elapsed = time.monotonic() - t0
    return list(served.values()), elapsed


def _role_stats(engine) -> dict | None:
    stats = engine.stats()
    role = stats.get("disaggregated")
    return None if role is None else {**role, "spec_decode": stats.get("spec_decode")}


def _delta(before: dict | None, after: dict | None) -> dict | None:
    """A role's counters after the timed run, with the run's own share of its KV traffic (`kv_run`;
    the latencies were reset after the warm-up)."""
    if after is None:
        return None
    kv_b, kv_a = before["kv"], after["kv"]
    out = dict(after)
    out["kv_run"] = {"transfers": kv_a["transfers"] - kv_b["transfers"], "bytes": kv_a["bytes"] - kv_b["bytes"],
                     "seconds_total": kv_a["seconds_total"] - kv_b["seconds_total"]}
    return out


if __name__ == "__main__":
    main(sys.argv[1])
