"""Pipeline parallelism in `toolkit bench throughput`: our engine as pp stages (a --variant with
pipeline_parallel_size), and the bubble model that predicts other stage counts from its stage times.

`PipelineSystem` runs the workload in pp processes under torch.distributed.run (cli/bench/
pipeline_worker.py: each rank one stage, `--threads` torch threads each, the workload timed as
OursSystem times it), and reports each stage's busy, compute and idle time during the timed run.

The bubble model (`bubble_model`), from those measured times, for pp = 1..8 stages on the same
workload:
- a plan (one step's batch) costs stage s  t_s = h + (l_s * w + [s is last] * e) * T / N_P: h is the
  host work per plan on every rank (schedule, inputs, sampling, update: busy minus compute), w the
  compute per token of one layer (the first stage's compute over its layers: its embedding is a
  gather), e that of the final norm and lm_head (the last stage's compute beyond its layers), l_s
  the stage's layers (the measured run's split at its pp, the engine's default split at the others), T the tokens the run fed and N_P the plans: with pp plans in
  flight each takes 1/pp of the live requests, so N_P = N_measured * P / P_measured;
- in steady state each stage works on P plans per cycle and a plan must pass every stage before
  its requests run again, so a plan takes max(max_s t_s, sum_s t_s / P) + d, d (P > 1 only) being
  the wait per plan that the measured bottleneck stage (the busiest) still had: hidden states and
  tokens in transit, and plans of unequal size. The run takes N_P times that; stage s idles
  1 - t_s / that.
Its inputs come from the measured run, so at the measured pp it is a consistency check; the other
stage counts are its predictions.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from toolkit.cli.bench.systems import BenchError, Phase, run_worker
from toolkit.cli.bench.workload import BenchRequest

WORKER = Path(__file__).with_name("pipeline_worker.py")
MAX_PREDICTED_STAGES = 8


class PipelineSystem:
    """Our engine with pipeline_parallel_size > 1, as that many processes under torch.distributed.run."""

    name = "toolkit"

    def __init__(self, label: str, model: Path, system_kwargs: dict, engine_args: dict, threads: int):
        self.label = label
        self.pp = int(engine_args["pipeline_parallel_size"])
        tp = int(engine_args.get("tensor_parallel_size", 1))
        if int(engine_args.get("data_parallel_size", 1)) != 1:
            raise BenchError("a pipeline --variant runs one replica: leave data_parallel_size out")
        self.world = self.pp * tp
        self.spec = dict(model=str(Path(model).resolve()), system=system_kwargs, engine_args=engine_args,
                         threads=threads)

    def throughput(self, requests: list[BenchRequest], warm: BenchRequest, phase: Phase,
                   timeout_s: float | None = None) -> dict:
        """Start-up and the timed throughput run in the workers; their result, with each stage's times."""
        pack = lambda r: {"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}  # noqa: E731
        spec = dict(self.spec, warm=pack(warm), requests=[pack(r) for r in requests])
        repo = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "OMP_NUM_THREADS": str(self.spec["threads"]), "TORCHINDUCTOR_COMPILE_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.world}",
                str(WORKER)]
        result, _ = run_worker(argv, spec, env, phase, self.label, "toolkit-bench-pp-", timeout_s=timeout_s)
        return result


def stage_delta(before: list[dict], after: list[dict]) -> list[dict]:
    """Each stage's times over one run: the counters after it less those before (Engine.pipeline_stats)."""
    from dataclasses import fields

    from toolkit.parallel.pipeline import StageStats

    counters = [f.name for f in fields(StageStats) if f.name != "max_in_flight"]
    return [{"stage": a["stage"], "layers": a["layers"],
             **StageStats(max_in_flight=a["max_in_flight"], **{k: a[k] - b[k] for k in counters}).as_dict()}
            for b, a in zip(before, after)]


def bubble_model(stages: list[dict], num_layers: int, tokens_fed: int, output_tokens: int,
                 max_stages: int = MAX_PREDICTED_STAGES, head_layers: float = 0.0) -> dict:
    """Predicted elapsed time, output tokens/s and per-stage idle for 1..max_stages stages (module
    docstring), from one measured run's `stages` (stage_delta), next to what that run measured.
    `head_layers`: the engine's estimate of the head in layers, which its default split uses."""
    from toolkit.parallel.pipeline import layer_partition

    measured_pp, plans = len(stages), stages[0]["plans"]
    if measured_pp < 2 or not plans or not tokens_fed:
        raise ValueError("the bubble model needs a run of two or more stages that computed something")
    first, last = stages[0], stages[-1]
    host = sum(s["busy_s"] - s["compute_s"] for s in stages) / len(stages) / plans
    layer = first["compute_s"] / (first["layers"][1] - first["layers"][0]) / tokens_fed
    head = max(0.0, last["compute_s"] / tokens_fed - layer * (last["layers"][1] - last["layers"][0]))
    wait = max(stages, key=lambda s: s["busy_s"])["idle_s"] / plans
    predictions = []
    for pp in range(1, min(max_stages, num_layers) + 1):
        num_plans = plans * pp / measured_pp
        # The measured run's own split (it may have been chosen); the engine's default for the others.
        split = ([s["layers"][1] - s["layers"][0] for s in stages] if pp == measured_pp
                 else layer_partition(num_layers, pp, head_layers=head_layers))
        times = [host + (layers * layer + (head if i == pp - 1 else 0.0)) * tokens_fed / num_plans
                 for i, layers in enumerate(split)]
        per_plan = max(max(times), sum(times) / pp) + (wait if pp > 1 else 0.0)
        elapsed = num_plans * per_plan
        predictions.append({"pp": pp, "elapsed_s": elapsed, "output_tokens_per_s": output_tokens / elapsed,
                            "idle_fraction": [1 - t / per_plan for t in times]})
    measured = {"pp": measured_pp, "idle_fraction": [s["idle_fraction"] for s in stages],
                "decode_idle_fraction": [s["decode_idle_fraction"] for s in stages]}
    return {"host_s_per_plan": host, "layer_s_per_token": layer, "head_s_per_token": head,
            "wait_s_per_plan": wait, "measured": measured, "predicted": predictions}


def report_lines(label: str, pipeline: dict, measured_tokens_per_s: float) -> list[str]:
    """The stages' idle shares and the bubble model's predictions, as lines under the bench's table."""
    model = pipeline["bubble_model"]
    stages = pipeline["stages"]
    lines = [f"{label}: idle per stage over the timed run "
             + ", ".join(f"stage {s['stage'] + 1} (layers {s['layers'][0]}-{s['layers'][1] - 1}) "
                         f"{100 * s['idle_fraction']:.1f}% (decode-only steps {100 * s['decode_idle_fraction']:.1f}%)"
                         for s in stages)
             + f"; up to {max(s['max_in_flight'] for s in stages)} plans in flight",
             f"bubble model (from this run: host {1e3 * model['host_s_per_plan']:.2f} ms and wait "
             f"{1e3 * model['wait_s_per_plan']:.2f} ms per plan; per token {1e6 * model['layer_s_per_token']:.1f} us "
             f"a layer, {1e6 * model['head_s_per_token']:.1f} us the head):"]
    for p in model["predicted"]:
        here = p["pp"] == model["measured"]["pp"]
        lines.append(f"  pp={p['pp']}: {p['output_tokens_per_s']:.1f} output tok/s, idle per stage "
                     + "/".join(f"{100 * f:.0f}%" for f in p["idle_fraction"])
                     + (f"   (measured: {measured_tokens_per_s:.1f} output tok/s, idle "
                        + "/".join(f"{100 * f:.0f}%" for f in model["measured"]["idle_fraction"]) + ")" if here else ""))
    return lines
