"""The program tests/parallel/test_parallel.py runs under torchrun (it holds no tests itself).

Every rank builds `LLM(model, tensor_parallel_size=..., data_parallel_size=...)` for each --model
in turn (with the n-th --speculative-config, if given, and --engine-args for all) (the same model may come several times: a process that builds engine after engine) and
generates greedily for the prompts in --prompts (the n-th --prompts for the n-th model, the last one for
the models after it), and with --sampled once more with those SamplingParams; each rank writes what it saw to <out>/rank<R>.json:
rank 0 the generated token ids, every rank its resident parameter bytes, its KV-cache shape and the
graphs each engine compiled. Fault injection for the failure tests: --model-for-rank gives one rank its own
copy of the checkpoint (e.g. one that lacks a shard file), --fail-rank/--fail-after-steps makes one
rank exit or hang in the middle of generation.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from torch.distributed.tensor import DTensor

from toolkit import LLM, SamplingParams

__test__ = False  # not a test module: pytest must not collect anything here


def main() -> None:
    args = parse_args()
    rank = int(os.environ["RANK"])
    prompt_sets = [json.loads(Path(path).read_text()) for path in args.prompts]
    overrides = dict(item.split("=", 1) for item in args.model_for_rank)
    report = {"rank": rank, "models": []}
    if args.result_head is not None:
        import toolkit.parallel.pipeline

        toolkit.parallel.pipeline.RESULT_HEAD = args.result_head
    specs = args.speculative_config + [None] * (len(args.model) - len(args.speculative_config))
    for i, (model, spec) in enumerate(zip(args.model, specs)):
        prompts = prompt_sets[min(i, len(prompt_sets) - 1)]
        path = overrides.get(str(rank), model)  # the failure tests pass a single --model
        llm = LLM(
            path, dtype="float32", enforce_eager=args.compile is None, compile_backend=args.compile or "inductor",
            max_model_len=128, block_size=16, skip_tokenizer_init=True,
            tensor_parallel_size=args.tp, data_parallel_size=args.dp, pipeline_parallel_size=args.pp,
            speculative_config=spec,
            **json.loads(args.engine_args),
        )
        if rank == args.fail_rank:
            fail_after(llm, args.fail_after_steps, args.fail_mode)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
        runner = llm.engine.runner
        sampled = None
        if args.sampled is not None:  # then a seeded sampled run with logprobs, every output reported
            sampled = [sampled_report(o) for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], SamplingParams(**json.loads(args.sampled)), use_tqdm=False)]
        report["models"].append({
            "sampled": sampled,
            "model": model,
            "tokens": [o.outputs[0].token_ids for o in outs],
            "param_bytes": resident_param_bytes(runner.model),
            "kv_shape": list(runner.kv_caches[0].shape),
            "kv_layers": len(runner.kv_caches),
            "param_names": sorted(name for name, _ in runner.model.named_parameters()),
            "pipeline": llm.engine.stats().get("pipeline"),
            "preemptions": llm.engine.stats()["preemptions"],
            "compiled_graphs": llm.engine.stats()["graphs"],
            "spec_decode": llm.engine.stats().get("spec_decode"),
            "kv_tiers": llm.engine.stats().get("kv_tiers"),
            "prefix_cache": llm.engine.stats()["prefix_cache"],
            **moe_report(llm),
        })
        del llm
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
    # Leave the process group before the interpreter tears down (toolkit.parallel.shutdown says why);
    # every launch then ends through the interpreter's own teardown, as a user's script does.
    from toolkit.parallel import shutdown

    shutdown()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", action="append", required=True)
    p.add_argument("--model-for-rank", action="append", default=[], metavar="RANK=PATH")
    p.add_argument("--prompts", action="append", required=True, metavar="JSON_FILE",
                   help="for the n-th --model, in order (the last serves the models after it)")
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--speculative-config", action="append", default=[], metavar="JSON",
                   help="for the n-th --model, in order (models without one decode plainly)")
    p.add_argument("--engine-args", default="{}", metavar="JSON", help="more LLM(...) keyword arguments, every model")
    p.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND", help="torch.compile (default: eager)")
    p.add_argument("--sampled", metavar="JSON", help="SamplingParams keywords of a second, sampled run per model")
    p.add_argument("--result-head", type=int, metavar="BYTES",
                   help="pipeline results' first-message size (parallel.pipeline.RESULT_HEAD): small sends most in two")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-after-steps", type=int, default=3)
    p.add_argument("--fail-mode", choices=("exit", "hang"), default="exit")
    return p.parse_args()


def sampled_report(out) -> dict:
    """A request's outputs as JSON: each sequence's tokens and per-token logprob entries, and the
    prompt logprobs ({token id: logprob} per position)."""
    entry = lambda e: None if e is None else {str(t): lp.logprob for t, lp in e.items()}  # noqa: E731
    return {"outputs": [{"tokens": c.token_ids, "logprobs": [entry(e) for e in c.logprobs or []]} for c in out.outputs],
            "prompt_logprobs": [entry(e) for e in out.prompt_logprobs or []]}


def fail_after(llm: LLM, steps: int, mode: str) -> None:
    """Make this rank fail in the middle of generation: vanish (no exception, no clean-up; its
    sockets close) or hang (alive and silent, as a frozen host looks: only a timeout can tell)."""
    step, count = llm.engine.step, [0]

    def failing_step():
        count[0] += 1
        if count[0] > steps:
            if mode == "exit":
                os._exit(17)
            time.sleep(3600)
        return step()

    llm.engine.step = failing_step


def moe_report(llm: LLM) -> dict:
    """Mixture-of-experts models: this rank's routed-expert parameters (count, first expert, shapes),
    its per-layer tokens_per_expert, and the expert-parallel counters; {} for a dense model."""
    from toolkit.parallel.expert_parallel import is_experts

    experts = [m for m in llm.engine.runner.model.modules() if is_experts(m)]
    if not experts:
        return {}
    return {
        "expert_params": sum(m.w13.numel() + m.w2.numel() for m in experts),
        "expert_shapes": [[list(m.w13.shape), list(m.w2.shape)] for m in experts[:1]],
        "first_expert": [m.first_expert for m in experts],
        "tokens_per_expert": [m.tokens_per_expert.tolist() for m in experts],
        "expert_parallel": llm.engine.stats().get("expert_parallel"),
    }


def resident_param_bytes(model) -> int:
    """Bytes of the storage behind this rank's parameters (shared storage, e.g. tied, counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


if __name__ == "__main__":
    main()
