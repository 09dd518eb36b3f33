"""`toolkit bench disagg`: disaggregated prefill/decode against the colocated engine on the same ranks.

The workload is mixed: a few long prompts among many short ones, every request asking for the same
number of output tokens, arriving at a given rate (Poisson, seeded) or all at once. Each system runs
as its own torch.distributed.run job on the same number of ranks (cli/bench/disagg_worker.py): the
colocated engine as data-parallel replicas (`--dp`, default 2), and each `--layout P:D` as P prefill
and D decode instances. The report gives, per system, TTFT, TPOT and ITL (p50, p99) as vLLM's bench
serve defines them, and for a disaggregated layout each role's queueing and latencies and the KV
handed over (bytes, transfers, time per transfer, bandwidth), beside the workload's prefill:decode
token ratio and the layout's P:D ratio. With `--rounds N` every system runs N times in mirrored
order and its rounds count as one run, so that a host drifting during the bench moves every system
alike (a shared host can change speed between one system's run and the next).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from toolkit.cli.bench.systems import BenchError, run_worker
from toolkit.cli.bench.workload import FIRST_RANDOM_ID

WORKER = Path(__file__).with_name("disagg_worker.py")
BLOCK = 16


def mixed_workload(num_requests: int, num_long: int, long_len: int, short_len: tuple[int, int], output_len: int,
                   rate: float, vocab_size: int, seed: int = 0) -> list[dict]:
    """`num_long` prompts of `long_len` tokens among short ones (uniform in `short_len`), shuffled,
    each asking for `output_len` tokens; arrival times (seconds) of a Poisson process of `rate`
    requests/s, or all 0 when rate is 0."""
    if not 0 <= num_long <= num_requests or num_requests < 1:
        raise ValueError(f"need 0 <= long prompts <= requests (>= 1), got {num_long} of {num_requests}")
    if not 1 <= short_len[0] <= short_len[1] or long_len < 1 or output_len < 1 or rate < 0:
        raise ValueError("lengths must be >= 1 (MIN <= MAX for --short-len) and --rate >= 0")
    rng = np.random.default_rng(seed)
    lens = [long_len] * num_long + rng.integers(short_len[0], short_len[1] + 1, num_requests - num_long).tolist()
    rng.shuffle(lens)
    gaps = rng.exponential(1 / rate, num_requests) if rate > 0 else np.zeros(num_requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    return [{"prompt_token_ids": rng.integers(FIRST_RANDOM_ID, vocab_size, int(n)).tolist(), "output_len": output_len,
             "arrival_s": float(a)} for n, a in zip(lens, arrivals)]


def parse_layout(text: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise typer.BadParameter(f"{text!r}: a layout is P:D, e.g. 1:1") from None
    if p < 1 or d < 1:
        raise typer.BadParameter(f"{text!r}: P and D must be >= 1")
    return p, d


def disagg(
    model: Annotated[Optional[Path], typer.Option("--model", "-m", help="Hugging Face model folder.")] = None,
    model_shape: Annotated[Optional[str], typer.Option(
        "--model-shape", help="A built-in shape with seeded random weights (e.g. 125m) instead of --model.")] = None,
    num_requests: Annotated[int, typer.Option(min=1, help="Requests in the workload.")] = 64,
    long_prompts: Annotated[int, typer.Option(min=0, help="How many of them have a long prompt.")] = 4,
    long_len: Annotated[int, typer.Option(min=1, help="Tokens of a long prompt.")] = 1900,
    short_len: Annotated[tuple[int, int], typer.Option(help="Short prompts' length range MIN MAX (uniform).")] = (32, 128),
    output_len: Annotated[int, typer.Option(min=1, help="Output tokens of every request (EOS ignored).")] = 128,
    rate: Annotated[float, typer.Option(min=0, help="Arrivals per second (Poisson); 0 = all at once.")] = 0.0,
    layout: Annotated[Optional[list[str]], typer.Option(
        help="A disaggregated layout P:D (prefill:decode instances, repeatable).")] = None,
    dp: Annotated[Optional[int], typer.Option(
        min=1, show_default=False, help="The colocated engine's replicas (default: one run per layout's rank count).")] = None,
    dtype: Annotated[str, typer.Option(help="Model dtype (auto = the checkpoint's).")] = "auto",
    eager: Annotated[bool, typer.Option("--eager", help="Run without torch.compile.")] = False,
    threads: Annotated[int, typer.Option(min=1, help="torch threads per rank.")] = 1,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1, help="Token budget per step (chunked prefill).")] = 512,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    max_local_prefill_tokens: Annotated[int, typer.Option(
        min=0, help="Disaggregated runs: prompts of at most this many tokens are computed by their decode "
                    "instance (conditional disaggregation); 0: every prompt is handed over.")] = 0,
    decode_token_cost: Annotated[Optional[list[float]], typer.Option(
        min=0.0, show_default=False,
        help="Disaggregated runs: a prefill instance also serves whole requests while less work is routed to it "
             "than to its decode instance, an output token counted as this many prompt tokens (about the ratio of "
             "a decode step's time per token to a prefill step's); 0: a prefill instance only prefills. Repeat it "
             "to run each layout once per value, beside the same colocated run. Default: 0.")] = None,
    speculative_config: Annotated[Optional[str], typer.Option(
        "--speculative-config", metavar="JSON",
        help="Also run each layout with this speculative_config on its decode instances (vLLM's dict as JSON, "
             "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}').")] = None,
    rounds: Annotated[int, typer.Option(
        min=1, help="Run every system this many times, the order reversed each round (colocated first, then "
                    "last, ...), and count a system's rounds as one run: its requests pooled, its throughput "
                    "their output tokens over their summed time. A host that drifts then moves every system "
                    "alike.")] = 1,
    json_path: Annotated[Optional[Path], typer.Option("--json", dir_okay=False, help="Also write the report here.")] = None,
):
    """Disaggregated prefill/decode against colocated replicas on the same ranks: TTFT and TPOT p50/p99."""
    from toolkit.cli.bench.model import resolve_model
    from toolkit.config import load_model_config

    err = Console(stderr=True)
    layouts = [parse_layout(t) for t in (layout or ["1:1"])]
    try:
        path, load_format = resolve_model(model, model_shape, need_weights=False)
        spec = None
        if speculative_config is not None:
            from toolkit.cli.errors import CliError
            from toolkit.cli.options import parse_speculative_config

            try:
                parse_speculative_config(speculative_config, path)  # a clear error before any process starts
            except CliError as e:
                raise ValueError(str(e)) from None
            spec = json.loads(speculative_config)  # the workers' engines take the dict
        mc = load_model_config(path)
        requests = mixed_workload(num_requests, long_prompts, long_len, short_len, output_len, rate, mc.vocab_size, seed)
    except (ValueError, FileNotFoundError) as e:
        err.print(f"error: {e}", style="red", markup=False)
        raise typer.Exit(2)
    longest = max(len(r["prompt_token_ids"]) + r["output_len"] for r in requests)
    if longest > mc.max_position_embeddings:
        err.print(f"error: a request needs {longest} tokens, more than the model's {mc.max_position_embeddings}",
                  style="red")
        raise typer.Exit(2)
    common = dict(dtype=dtype, enforce_eager=eager, skip_tokenizer_init=True, load_format=load_format, seed=0,
                  max_model_len=math.ceil(longest / BLOCK) * BLOCK, max_num_batched_tokens=max_num_batched_tokens)
    # The colocated peer on the same ranks as each layout (or --dp replicas).
    worlds = [dp] if dp else sorted({p + d for p, d in layouts})
    systems = [(f"colocated (dp={n})", {"data_parallel_size": n}) for n in worlds]
    local = {"max_local_prefill_tokens": max_local_prefill_tokens} if max_local_prefill_tokens else {}
    costs = decode_token_cost or [0.0]
    for speculating in ([False, True] if spec is not None else [False]):  # then the same, speculating
        systems += [(f"disaggregated {p}:{d}" + (f" + {spec['method']}" if speculating else "")
                     + (f", decode token cost {c:g}" if c else ""),
                     {"prefill_instances": p, "decode_instances": d, **local, **({"decode_token_cost": c} if c else {}),
                      **({"speculative_config": spec} if speculating else {})})
                    for p, d in layouts for c in costs]
    # Warm-up requests that reach every instance's graphs before the timing: one a prefill instance
    # computes (longer than max_local_prefill_tokens) and, with conditional disaggregation, one its
    # decode instance computes itself. (With only a 64-token one, N >= 64 left the prefill rank to
    # compile inside the timed run.)
    source = max((r["prompt_token_ids"] for r in requests), key=len)
    warm = [{"prompt_token_ids": source[:max(64, max_local_prefill_tokens + 1)], "output_len": 4, "arrival_s": 0.0}]
    if max_local_prefill_tokens > 1:
        warm.append({"prompt_token_ids": source[:max_local_prefill_tokens], "output_len": 4, "arrival_s": 0.0})
    if any(costs):  # and one a prefill instance serves whole: after a long output, a short prompt
        warm[0]["output_len"] = min(math.ceil((len(warm[0]["prompt_token_ids"]) + 32) / min(c for c in costs if c)) + 1,
                                    common["max_model_len"] - len(warm[0]["prompt_token_ids"]))
        warm.append({"prompt_token_ids": source[:max(16, max_local_prefill_tokens + 1)], "output_len": 4,
                     "arrival_s": 0.0})
    runs: dict[str, list[dict]] = {label: [] for label, _ in systems}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=False) as bar:
        def phase(description: str, total: int):
            task = bar.add_task(description, total=total)
            return lambda n=1: bar.update(task, advance=n)

        for r, (label, engine_args) in round_order(systems, rounds):
            nproc = engine_args.get("data_parallel_size") or engine_args["prefill_instances"] + engine_args["decode_instances"]
            spec = dict(model=str(Path(path).resolve()), engine_args={**common, **engine_args}, threads=threads,
                        requests=requests, warm=warm)
            repo = str(Path(__file__).resolve().parents[2])
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TORCHINDUCTOR_COMPILE_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                    str(WORKER)]
            shown = label + (f" (round {r + 1} of {rounds})" if rounds > 1 else "")
            try:
                runs[label].append(run_worker(argv, spec, env, phase, shown, "toolkit-bench-disagg-")[0])
            except BenchError as e:
                err.print(f"error: {e}", style="red", markup=False)
                raise typer.Exit(1)
    results = {label: combine_rounds(done) for label, done in runs.items()}
    for label, engine_args in systems[len(worlds):]:
        # Greedy, EOS ignored: the same tokens as the colocated run, up to a near-tie that other batch
        # shapes (other kernels, other summation orders) can flip, often in low precision.
        p, d = engine_args["prefill_instances"], engine_args["decode_instances"]
        peer = results[f"colocated (dp={dp or p + d})"]["tokens"]
        results[label]["requests_identical_to_colocated"] = sum(a == b for a, b in zip(results[label]["tokens"], peer))
        results[label]["first_differences"] = first_differences(results[label]["tokens"], peer)
    report = {"workload": workload_summary(requests, rate, long_len), "systems": results,
              "layouts": [f"{p}:{d}" for p, d in layouts]}
    for line in report_lines(report):
        print(line)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2))


def round_order(systems: list, rounds: int) -> list[tuple[int, object]]:
    """(round, system) in run order: the systems as given, then reversed, and so on, so that each
    system's rounds sit at mirrored places in the whole run (colocated first and last with two)."""
    return [(r, s) for r in range(rounds) for s in (systems if r % 2 == 0 else systems[::-1])]


def combine_rounds(runs: list[dict]) -> dict:
    """One system's rounds as one run: every round's requests pooled into the latency figures, the
    throughput their output tokens over the rounds' summed time; the tokens and role counters of the
    first round (every round's figures stay under `rounds`)."""
    from toolkit.cli.bench.metrics import RequestTiming, latency_metrics

    timings = [RequestTiming.from_json(t) for run in runs for t in run["timings"]]
    first = runs[0]
    return {**{k: v for k, v in first.items() if k != "timings"},
            "latency": latency_metrics(timings, sum(run["latency"]["duration_s"] for run in runs)),
            "rounds": [{"latency": run["latency"], "roles": run["roles"]} for run in runs]}


def workload_summary(requests: list[dict], rate: float, long_len: int) -> dict:
    prompt = sum(len(r["prompt_token_ids"]) for r in requests)
    output = sum(r["output_len"] for r in requests)
    return {"requests": len(requests), "prompt_tokens": prompt, "output_tokens": output,
            "prefill_to_decode_tokens": prompt / output, "rate": rate,
            "long_prompts": sum(len(r["prompt_token_ids"]) == long_len for r in requests)}


def first_differences(tokens: list[list[int]], peer: list[list[int]]) -> list[list[int]]:
    """[request, position of its first token that differs, the peer's token count] of each request whose
    tokens differ from the peer's: a near-tie flips late in a sequence, a fault from its first tokens."""
    out = []
    for i, (got, want) in enumerate(zip(tokens, peer)):
        if got != want:
            at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            out.append([i, at, len(want)])
    return out


def report_lines(report: dict) -> list[str]:
    w = report["workload"]
    lines = [f"workload: {w['requests']} requests ({w['long_prompts']} long), {w['prompt_tokens']} prompt and "
             f"{w['output_tokens']} output tokens (prefill:decode {w['prefill_to_decode_tokens']:.2f}:1), "
             + (f"{w['rate']} requests/s" if w["rate"] else "all at once"),
             f"{'system':<26} {'TTFT p50':>10} {'TTFT p99':>10} {'TPOT p50':>10} {'TPOT p99':>10} {'ITL p99':>10} "
             f"{'out tok/s':>10}"]
    for label, res in report["systems"].items():
        lat = res["latency"]
        ttft, tpot = lat["ttft_ms"], lat["tpot_ms"]
        lines.append(f"{label:<26} {ttft['median']:>8.1f}ms {ttft['p99']:>8.1f}ms {tpot['median']:>8.1f}ms "
                     f"{tpot['p99']:>8.1f}ms {lat['itl_ms']['p99']:>8.1f}ms {lat['output_tokens_per_s']:>10.1f}")
    for label, res in report["systems"].items():
        if len(res.get("rounds", [])) > 1:  # each round's own figures: the host's drift between them
            each = [r["latency"] for r in res["rounds"]]
            lines.append(f"  {label}, each round: out tok/s " + " / ".join(f"{r['output_tokens_per_s']:.1f}" for r in each)
                         + ", TPOT p99 " + " / ".join(f"{r['tpot_ms']['p99']:.1f}" for r in each) + " ms")
        if "requests_identical_to_colocated" in res:
            same = res["requests_identical_to_colocated"]
            where = ", ".join(f"request {i} from token {at} of {n}" for i, at, n in res.get("first_differences", [])[:5])
            lines.append(f"  {label}: {same} of {w['requests']} requests' tokens identical to the colocated run's"
                         + ("" if same == w["requests"] else
                            (f"; differing: {where}" if where else "")
                            + " (a row's kernel path and summation order follow its step's batch shape, which differs "
                            "between the two, so greedy near-ties can flip: often in bf16 or fp16, rarely in float32; "
                            "a request differing from its first tokens would be a fault)"))
        for role in (r for r in res["roles"] if r and r["local_rank"] == 0):
            lines.append(f"  {label}, {role['role']} instance {role['instance']}: " + role_line(role))
    return lines


def role_line(role: dict) -> str:
    ms = lambda v: "-" if v is None else f"{1000 * v:.1f}"  # noqa: E731
    kv = role["kv_run"]
    parts = [f"queue p50/p99 {ms(role['queue']['p50'])}/{ms(role['queue']['p99'])} ms"]
    if role["role"] == "prefill":
        parts.append(f"KV ready p50/p99 {ms(role['ttft']['p50'])}/{ms(role['ttft']['p99'])} ms after arrival")
        parts.append(f"{kv['transfers']} prompts' KV sent, {kv['bytes'] / 2**20:.1f} MiB")
        served = role["served"]
        if served["requests"]:
            parts.append(f"{served['requests']} served whole, TTFT p50 {ms(served['ttft']['p50'])} ms, "
                         f"TPOT p50/p99 {ms(served['tpot']['p50'])}/{ms(served['tpot']['p99'])} ms")
    else:
        per = role["kv"]
        rate = kv["bytes"] / kv["seconds_total"] / 1e9 if kv["seconds_total"] else 0.0
        # (posted when READY came: the wait is what was still arriving when the request was admitted)
        parts.append(f"{kv['transfers']} received, {kv['bytes'] / 2**20:.1f} MiB, wait at admission p50/p99 "
                     f"{ms(per['seconds_p50'])}/{ms(per['seconds_p99'])} ms ({rate:.2f} GB/s while waited)")
        parts.append(f"TTFT p50 {ms(role['ttft']['p50'])} ms, TPOT p50 {ms(role['tpot']['p50'])} ms")
        spec = role.get("spec_decode")
        if spec and spec["acceptance_rate"] is not None:  # since start, the warm-up's few drafts included
            parts.append(f"drafts accepted {100 * spec['acceptance_rate']:.0f}%, mean acceptance length "
                         f"{spec['mean_acceptance_length']:.2f}")
    return "; ".join(parts)
