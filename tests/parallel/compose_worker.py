"""The program tests/parallel/test_composition.py runs under torchrun (it holds no tests itself).

Every rank builds one LLM per case of --cases (a JSON list of {"name", "model", "engine_args",
"sampled"}) in turn, with the launch's --tp/--dp/--pp, generates greedily for --prompts (and, when
"sampled" holds SamplingParams keywords, once more with those), and writes <out>/rank<R>.json:
rank 0 the outputs, every rank its engine's counters (preemptions, drafts, tiers, prefix cache,
its pipeline stage, expert parallelism).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tests.parallel.worker import sampled_report
from toolkit import LLM, SamplingParams

__test__ = False  # not a test module: pytest must not collect anything here


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=10)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    prompts = [{"prompt_token_ids": t} for t in json.loads(Path(args.prompts).read_text())]
    report = {"rank": rank, "cases": {}}
    for case in json.loads(Path(args.cases).read_text()):
        llm = LLM(case["model"], dtype="float32", enforce_eager=True, max_model_len=128, block_size=16,
                  skip_tokenizer_init=True, cpu_linear="torch", tensor_parallel_size=args.tp,
                  data_parallel_size=args.dp, pipeline_parallel_size=args.pp, **case["engine_args"])
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
        sampled = None
        if case.get("sampled"):
            sampled = [sampled_report(o) for o in llm.generate(prompts, SamplingParams(**case["sampled"]),
                                                                 use_tqdm=False)]
        stats = llm.engine.stats()
        kv = llm.engine.scheduler.kv_cache
        report["cases"][case["name"]] = {
            "tokens": [o.outputs[0].token_ids for o in outs], "sampled": sampled,
            "preemptions": stats["preemptions"], "spec_decode": stats.get("spec_decode"),
            "kv_tiers": stats.get("kv_tiers"), "prefix_cache": stats["prefix_cache"],
            "pipeline": stats.get("pipeline"), "expert_parallel": stats.get("expert_parallel"),
            "kv_blocks": kv.num_blocks, "blocks_free": kv.num_free_blocks == kv.num_blocks,
            "draft_runner": stats.get("draft_runner") is not None,
            "int8_linears": sum(type(m).__name__ in ("Int8Linear", "CPUInt8Linear")
                                for m in llm.engine.runner.model.modules()),
        }
        del llm
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
    from toolkit.parallel import shutdown

    shutdown()


if __name__ == "__main__":
    main()
