"""Expert parallelism's traffic and time per step, under torchrun: all-to-all bytes, time in the
all-to-alls, time in the whole experts op, and the step time, on the bench's MoE shape.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        recipes/ep_all_to_all.py --dp 2            # or --tp 2; --out report.json

Weights are seeded random (load_format="dummy"): traffic and time do not depend on their values, only
on the shapes and on the routing (here: whatever the random router picks, reported as imbalance).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import torch.distributed as dist  # noqa: E402

from toolkit import LLM, SamplingParams  # noqa: E402
from toolkit.cli.bench.model import shape_config_only  # noqa: E402
from toolkit.cli.bench.workload import random_workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--shape", default="moe-0.5b")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    llm = LLM(str(shape_config_only(args.shape)), load_format="dummy", dtype="bfloat16", enforce_eager=args.eager,
              tensor_parallel_size=args.tp, data_parallel_size=args.dp, enable_expert_parallel=True,
              max_model_len=1024)
    vocab = llm.engine.model_config.vocab_size
    work = random_workload(args.requests, (32, 256), (32, 256), vocab, seed=0)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in work]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in work]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=2)] * 2, use_tqdm=False)  # warm-up: compile
    before = dict(llm.engine.stats()["expert_parallel"])
    steps, start = _count_steps(llm), time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.engine.stats()["expert_parallel"]
    report = _report(before, after, steps(), elapsed, llm)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if dist.get_rank() == 0:
        doc = {"shape": args.shape, "tp": args.tp, "dp": args.dp, "requests": args.requests, "ranks": gathered}
        print(json.dumps(doc, indent=2))
        if args.out:
            args.out.write_text(json.dumps(doc, indent=2) + "\n")


def _count_steps(llm):
    engine, count = llm.engine, {"n": 0}
    real = engine.step

    def step():
        count["n"] += 1
        return real()

    engine.step = step
    return lambda: count["n"]


def _report(before: dict, after: dict, steps: int, elapsed: float, llm) -> dict:
    d = {k: after[k] - before[k] for k in ("calls", "dispatch_bytes", "combine_bytes", "all_to_all_s", "op_s")}
    layers = max(1, d["calls"] // max(steps, 1))
    return {"rank": dist.get_rank(), "experts": after["experts"], "steps": steps, "moe_layer_calls": d["calls"],
            "layers_per_step": layers, "elapsed_s": elapsed,
            "all_to_all_mib_per_step": (d["dispatch_bytes"] + d["combine_bytes"]) / 2**20 / max(steps, 1),
            "all_to_all_ms_per_step": 1e3 * d["all_to_all_s"] / max(steps, 1),
            "experts_op_ms_per_step": 1e3 * d["op_s"] / max(steps, 1),
            "step_ms": 1e3 * elapsed / max(steps, 1),
            "dummy_steps": after.get("dummy_steps")}


if __name__ == "__main__":
    main()
