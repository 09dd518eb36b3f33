"""The vLLM side of `toolkit bench --peer vllm`, run by the Python of a separate environment with vLLM.

Not part of the toolkit and never imported by it: it needs only the standard library and vLLM.
Usage: `PYTHON vllm_worker.py SPEC.json`. The spec names the model, the engine settings, the
mode and the requests (token ids and output lengths). Progress and the result are JSON lines on
stdout ({"event": "phase" | "advance" | "result", ...}); vLLM's own logs go to stderr.

Measured the same way as our engine (see cli/bench/systems.py): start-up = constructing `LLM` plus
one 2-token warm-up request; throughput = `LLM.generate` on all requests; latency and the batch-1
decode run = `LLMEngine.add_request` / `step()` with DELTA outputs, one timestamp after each step.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def wait_for_probe(spec: dict) -> None:
    """Stand still while the parent probes memory bandwidth beside the decode run; it writes a line when done."""
    if spec.get("wait_for_probes"):
        emit(event="probe")
        sys.stdin.readline()


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    def params(output_len: int, kind=None) -> SamplingParams:
        sp = SamplingParams(temperature=spec.get("temperature", 0.0), max_tokens=output_len, ignore_eos=True,
                            detokenize=False)
        if kind is not None:
            sp.output_kind = kind
        return sp

    def prompt(r: dict) -> dict:
        return {"prompt_token_ids": r["prompt_token_ids"]}

    def generate_all(reqs: list[dict]) -> int:
        outs = llm.generate([prompt(r) for r in reqs], [params(r["output_len"]) for r in reqs], use_tqdm=False)
        tokens = 0
        for r, out in zip(reqs, outs):
            got = len(out.outputs[0].token_ids)
            if got != r["output_len"]:
                raise SystemExit(f"vLLM produced {got} tokens for a request of {r['output_len']}")
            tokens += got
        return tokens

    emit(event="phase", name="start-up (construct + warm-up)", total=1)
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], skip_tokenizer_init=True, seed=0,
              max_model_len=spec["max_model_len"], enforce_eager=spec["enforce_eager"],
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              enable_prefix_caching=spec.get("enable_prefix_caching", True),
              **({"speculative_config": spec["speculative_config"]} if spec.get("speculative_config") else {}))
    constructed = time.perf_counter() - start
    generate_all([spec["warm"]])
    total = time.perf_counter() - start
    emit(event="advance", n=1)
    result = {"version": vllm.__version__,
              "startup": {"total_s": total, "construct_s": constructed, "warmup_s": total - constructed}}

    engine = llm.llm_engine
    counter = [0]

    def stepped(reqs: list[dict], concurrency: int, name: str) -> tuple[list[dict], float]:
        """At most `concurrency` in flight; one timestamp after each step, a chunk per request that grew."""
        emit(event="phase", name=name, total=len(reqs))
        queue = deque(reqs)
        inflight: dict[str, dict] = {}
        timings = []

        def admit():
            while queue and len(inflight) < concurrency:
                r = queue.popleft()
                rid = f"bench-{counter[0]}"
                counter[0] += 1
                now = time.monotonic()
                timing = {"arrival": now, "prompt_len": len(r["prompt_token_ids"]), "chunks": [], "want": r["output_len"]}
                internal = engine.add_request(rid, prompt(r), params(r["output_len"], RequestOutputKind.DELTA))
                inflight[rid] = timing
                if internal != rid:
                    inflight[internal] = timing

        begin = time.monotonic()
        admit()
        while inflight or engine.has_unfinished_requests():
            outs = engine.step()
            now = time.monotonic()
            for out in outs:
                timing = inflight.get(out.request_id)
                if timing is None:
                    continue
                n = len(out.outputs[0].token_ids) if out.outputs else 0
                if n:
                    timing["chunks"].append([now, n])
                if out.finished:
                    got = sum(c[1] for c in timing["chunks"])
                    if got != timing.pop("want"):
                        raise SystemExit(f"vLLM produced {got} tokens for request {out.request_id}")
                    for key in [k for k, v in inflight.items() if v is timing]:
                        del inflight[key]
                    timings.append(timing)
                    emit(event="advance", n=1)
            admit()
        return timings, time.monotonic() - begin

    reqs = spec["requests"]
    # Each timed run starts without what the warm-up left cached, as ours does.
    llm.reset_prefix_cache()
    before = prefix_counters(llm)
    if spec["mode"] == "throughput":
        emit(event="phase", name="throughput (LLM.generate)", total=1)
        start = time.perf_counter()
        tokens = generate_all(reqs)
        elapsed = time.perf_counter() - start
        emit(event="advance", n=1)
        prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
        result["throughput"] = {
            "num_requests": len(reqs), "prompt_tokens": prompt_tokens, "output_tokens": tokens, "elapsed_s": elapsed,
            "requests_per_s": len(reqs) / elapsed, "output_tokens_per_s": tokens / elapsed,
            "total_tokens_per_s": (prompt_tokens + tokens) / elapsed,
        }
    else:
        timings, duration = stepped(reqs, spec["concurrency"], "latency")
        result["latency"] = {"timings": timings, "duration_s": duration}
    after = prefix_counters(llm)
    if after is not None and before is not None:
        result["kv_cache"] = {k: after[k] - before[k] for k in after}
    if spec.get("decode"):
        llm.reset_prefix_cache()
        wait_for_probe(spec)
        timings, _ = stepped([spec["decode"]], 1, "batch-1 decode")
        wait_for_probe(spec)
        result["decode"] = timings[0]
    if spec.get("speculative_config"):
        result["spec_decode"] = spec_metrics(llm)
    emit(event="result", result=result)


def prefix_counters(llm) -> dict | None:
    """vLLM's prefix-cache counters so far (tokens), in our report's names."""
    try:
        metrics = {m.name: m for m in llm.get_metrics()}
    except Exception:  # noqa: BLE001 - an older vLLM, or metrics disabled
        return None
    queries, hits = metrics.get("vllm:prefix_cache_queries"), metrics.get("vllm:prefix_cache_hits")
    if queries is None or hits is None:
        return None
    return {"queries": queries.value, "hits": hits.value, "device_hits": hits.value}


def spec_metrics(llm) -> dict | None:
    """vLLM's own spec-decode counters (the whole run, warm-up included), in our report's fields."""
    try:
        metrics = {m.name: m for m in llm.get_metrics()}
    except Exception:  # noqa: BLE001 - an older vLLM, or metrics disabled
        return None
    get = lambda name: getattr(metrics.get(f"vllm:spec_decode_{name}"), "value", None)  # noqa: E731
    drafts, tokens, accepted = get("num_drafts"), get("num_draft_tokens"), get("num_accepted_tokens")
    if not drafts or not tokens:
        return None
    per_pos = list(getattr(metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos"), "values", []) or [])
    return {"num_drafts": drafts, "num_draft_tokens": tokens, "num_accepted_tokens": accepted,
            "accepted_per_pos": per_pos, "acceptance_rate_pct": 100 * accepted / tokens,
            "mean_acceptance_length": 1 + accepted / drafts,
            "acceptance_per_pos_pct": [100 * n / drafts for n in per_pos]}


if __name__ == "__main__":
    main(sys.argv[1])
