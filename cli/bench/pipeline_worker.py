"""The program `PipelineSystem` (cli/bench/pipeline.py) runs under torch.distributed.run, one process per
pipeline stage: every rank starts our engine with the spec's EngineConfig fields and runs the same
timed throughput workload (OursSystem's), its stages' times are taken around the run, and rank 0
prints the events and the result as JSON lines on stdout (cli/bench/systems.py::run_worker)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

__test__ = False


def main(spec_path: str) -> None:
    from toolkit.cli.bench.pipeline import stage_delta
    from toolkit.cli.bench.systems import OursSystem, no_progress
    from toolkit.cli.bench.workload import BenchRequest
    from toolkit.parallel import shutdown

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    main_rank = int(os.environ.get("RANK", "0")) == 0
    emit = (lambda event: print(json.dumps(event), flush=True)) if main_rank else (lambda event: None)

    def phase(name: str, total: int):
        emit({"event": "phase", "name": name.split(": ", 1)[-1], "total": total})
        return lambda n=1: emit({"event": "advance", "n": n})

    unpack = lambda r: BenchRequest(r["prompt_token_ids"], r["output_len"])  # noqa: E731
    system = OursSystem(Path(spec["model"]), **spec["system"], engine_args=spec["engine_args"])
    startup = system.start(unpack(spec["warm"]))
    before = system.llm.engine.pipeline_stats()
    throughput = system.throughput([unpack(r) for r in spec["requests"]], phase if main_rank else no_progress)
    stages = stage_delta(before, system.llm.engine.pipeline_stats())
    startup.pop("engine")  # this rank's engine stats: not what the report shows
    emit({"event": "result", "result": {"startup": startup, "throughput": throughput,
                                        "tokens": system.tokens["throughput"], "stages": stages}})
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
