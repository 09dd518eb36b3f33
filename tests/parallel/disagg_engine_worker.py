"""The program tests/parallel/test_disaggregated.py runs under torchrun for the engine's disaggregated
mode (it holds no tests itself). For each --layout (a JSON dict of LLM keywords: prefill_instances,
decode_instances, tensor_parallel_size, prefill_tensor_parallel_size, and any other engine field such
as speculative_config or a KV tier; with "model", for that model alone) and each --model, every rank
builds the LLM, generates greedily for --prompts and, with --sampled, once more with those
SamplingParams; each rank writes <out>/rank<R>.json: per run its role, the outputs rank 0 returned,
whether every KV block of its instance is free afterwards, and its handoff and transfer counters.
--fail-rank/--fail-mode make one rank exit or hang in its third step, for the fault tests.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from tests.parallel.worker import sampled_report
from toolkit import LLM, SamplingParams

__test__ = False


def main() -> None:
    args = parse_args()
    rank = int(os.environ["RANK"])
    prompts = json.loads(Path(args.prompts).read_text())
    report = {"rank": rank, "runs": []}
    for layout in map(json.loads, args.layout):
        models = [layout.pop("model")] if "model" in layout else args.model
        # "priorities": "reversed": the later a prompt, the sooner it is admitted (scheduling_policy="priority")
        priority = list(range(len(prompts), 0, -1)) if layout.get("priorities") == "reversed" else None
        for model in models:
            llm = LLM(model, dtype="float32", enforce_eager=args.compile is None,
                      compile_backend=args.compile or "inductor", max_model_len=128, block_size=16,
                      skip_tokenizer_init=True,
                      **{**json.loads(args.engine_args), **{k: v for k, v in layout.items() if k != "priorities"}})
            if rank == args.fail_rank:
                fail_in_third_step(llm, args.fail_mode)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False,
                                priority=priority)
            sampled = None
            if args.sampled is not None:
                sampled = [sampled_report(o) for o in llm.generate(
                    [{"prompt_token_ids": p} for p in prompts], SamplingParams(**json.loads(args.sampled)),
                    use_tqdm=False, priority=priority)]
            engine = llm.engine
            stats = engine.stats()
            report["runs"].append({
                "layout": layout, "model": model,
                "tokens": [o.outputs[0].token_ids for o in outs], "sampled": sampled,
                "all_blocks_free": engine.scheduler.num_free_blocks == engine.runner.kv_spec.num_blocks,
                "running": engine.scheduler.num_running + engine.scheduler.num_waiting,
                "kv_heads": engine.runner.kv_caches[0].shape[3], "kv_blocks": engine.runner.kv_spec.num_blocks,
                "kv_layers": len(engine.runner.kv_caches),
                "disaggregated": stats["disaggregated"],
                "prefix_cache": stats["prefix_cache"],
                "compiled_graphs": stats["graphs"],
                "spec_decode": stats.get("spec_decode"), "draft_runner": stats.get("draft_runner") is not None,
                "kv_tiers": stats.get("kv_tiers"), "preemptions": stats["preemptions"],
                "expert_parallel": stats.get("expert_parallel"),
                "int8_linears": sum(type(m).__name__ in ("Int8Linear", "CPUInt8Linear")
                                    for m in engine.runner.model.modules()),
                "metrics": sorted({m.name for m in llm.get_metrics() if m.name.startswith("toolkit:disagg")}),
            })
            if args.abort_half:
                report["runs"][-1]["aborted_run"] = abort_half(engine, prompts, args.max_tokens)
                report["runs"][-1]["blocks_free_after_abort"] = (engine.scheduler.num_free_blocks
                                                                 == engine.runner.kv_spec.num_blocks)
            del llm, engine
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
    from toolkit.parallel import shutdown

    shutdown()


def abort_half(engine, prompts: list[list[int]], max_tokens: int) -> dict | None:
    """Every prompt added, every other one aborted at once (still at its prefill instance's door, or
    awaited by its decode instance), the rest run to their end: on global rank 0, the finished ones'
    tokens from every decode instance (None elsewhere)."""
    from toolkit import SamplingParams

    ids = [f"abort-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    for rid in ids[::2]:
        engine.abort_request(rid)
    finished = {}
    while engine.has_unfinished():
        finished.update({out.request_id: out.outputs[0].token_ids for out in engine.step()})
    parts = engine.front.collect(engine, finished)
    return None if parts is None else {rid: tokens for part in parts for rid, tokens in part.items()}


def fail_in_third_step(llm: LLM, mode: str) -> None:
    step, count = llm.engine.step, [0]

    def failing_step():
        count[0] += 1
        if count[0] == 3:
            if mode == "exit":
                os._exit(17)
            time.sleep(3600)
        return step()

    llm.engine.step = failing_step


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", action="append", required=True)
    p.add_argument("--prompts", required=True, metavar="JSON_FILE")
    p.add_argument("--layout", action="append", required=True, metavar="JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=10)
    p.add_argument("--engine-args", default="{}", metavar="JSON")
    p.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND")
    p.add_argument("--sampled", metavar="JSON")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-mode", choices=("exit", "hang"), default="exit")
    p.add_argument("--abort-half", action="store_true", help="after the runs, abort_half on the same engine")
    return p.parse_args()


if __name__ == "__main__":
    main()
