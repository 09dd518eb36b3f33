"""`toolkit bench`: offline throughput and latency of our engine, against peers measured in the same run.

Every figure is reported next to the same figure of each peer (transformers' `generate`, vLLM's
CPU build in its own environment) and as a ratio ours / peer, because absolute numbers on a shared
machine are noisy and ratios taken minutes apart are much less so. The machine's roofline (matmul
peak in the model's dtype, memory read bandwidth) is measured in the same run too. Definitions and
formulas: cli/bench/metrics.py, cli/bench/roofline.py and docs/benchmarks.md.

The lead registers this sub-app in cli/main.py: `app.add_typer(bench_app, name="bench")`.
"""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from toolkit.cli.bench.metrics import (combine_throughput, decode_metrics, expert_delta, kv_delta, latency_metrics,
                                       spec_delta)
from toolkit.cli.bench.model import SHAPES, resolve_model
from toolkit.cli.bench.pipeline import PipelineSystem, bubble_model, report_lines
from toolkit.cli.bench.disaggregated import disagg
from toolkit.cli.bench.serving import serve
from toolkit.cli.bench.suite import suite
from toolkit.cli.bench.goals import table
from toolkit.cli.bench.report import build_rows, render_table, report_json
from toolkit.cli.bench.roofline import (
    bandwidth_fraction, best_of_probes, compute_peak, decode_bytes_per_token, dtype_bytes, layer_linear_params, machine_info, matmul_peak, memory_bandwidth,
    workload_flops,
)
from toolkit.cli.bench.systems import BenchError, HFSystem, OursSystem, VLLMSystem, python_of
from toolkit.cli.bench.workload import (
    BenchRequest,
    load_dataset,
    multi_turn_workload,
    prefix_repetition_workload,
    random_workload,
    workload_summary,
)
from toolkit.cli.help import GroupedHelpCommand
from toolkit.cli.options import VerboseOpt

bench_app = typer.Typer(
    help="Benchmark the engine (throughput, latency) against transformers and vLLM in the same run.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain --help, grouped (cli/help.py)
)

PEERS = ("hf", "vllm")
BLOCK = 16  # the engine's default block size: KV sizing below counts in its blocks

ModelOpt = Annotated[Optional[Path], typer.Option("--model", "-m", help="Hugging Face model folder.",
                                                  file_okay=False)]
ShapeOpt = Annotated[Optional[str], typer.Option(
    "--model-shape", help=f"A built-in seeded random model instead of --model: {', '.join(SHAPES)} (a ~125M Llama; "
    "a Qwen3-MoE, 16 experts, top-2, ~0.5B total, ~100M active; both bf16). Alone it uses dummy weights; with a peer, a real checkpoint cached under ~/.cache/toolkit/bench.")]
# No -n: everywhere else -n is completions per prompt (vLLM's n).
NumOpt = Annotated[int, typer.Option("--num-requests", min=1, help="Requests in the workload.")]
InOpt = Annotated[tuple[int, int], typer.Option("--input-len", help="Prompt length range MIN MAX (uniform).")]
OutOpt = Annotated[tuple[int, int], typer.Option("--output-len", help="Output length range MIN MAX (uniform).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Workload seed: the same seed gives the same requests.")]
TemperatureOpt = Annotated[float, typer.Option(
    "--temperature", min=0.0, help="0: greedy (every system's tokens comparable). Above 0: every request samples at "
    "this temperature, without top-k/top-p, in every system (the sampler's cost counted; tokens not compared).")]
DatasetOpt = Annotated[Optional[Path], typer.Option(
    "--dataset", dir_okay=False, exists=True,
    help="JSONL workload instead of random prompts: 'prompt' or 'prompt_token_ids', and 'max_tokens', per line.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="Model dtype (auto = the checkpoint's).")]
EagerOpt = Annotated[bool, typer.Option("--eager", help="Run our engine without torch.compile.")]
BothOpt = Annotated[bool, typer.Option("--both", help="Run our engine compiled and eager (two columns).")]
PeerOpt = Annotated[Optional[list[str]], typer.Option(
    "--peer", help="A peer measured in the same run: hf (transformers generate) or vllm (needs --peer-python). Repeatable.")]
PeerPyOpt = Annotated[Optional[Path], typer.Option(
    "--peer-python", envvar="TOOLKIT_BENCH_VLLM_PYTHON",
    help="Python executable (or venv folder) of an environment with vLLM, for --peer vllm.")]
HFBatchOpt = Annotated[int, typer.Option("--hf-batch-size", min=1, help="transformers' static batch size (throughput).")]
VLLMEagerOpt = Annotated[bool, typer.Option("--vllm-eager", help="Run vLLM with enforce_eager (default: its compiled mode).")]
JsonOpt = Annotated[Optional[Path], typer.Option("--json", dir_okay=False, help="Also write the report as JSON here.")]
SeqsOpt = Annotated[int, typer.Option("--max-num-seqs", min=1, help="Requests per step (ours and vLLM).")]
TokensOpt = Annotated[int, typer.Option("--max-num-batched-tokens", min=1, help="Token budget per step (ours and vLLM).")]
KVOpt = Annotated[Optional[float], typer.Option(
    "--kv-cache-gib", min=0.001, help="Our KV cache size (default: what the whole workload needs at once, at most 4 GiB).")]
DecodeOpt = Annotated[int, typer.Option(
    "--decode-tokens", min=0, help="Tokens of the batch-1 decode run (memory-bandwidth fraction); 0 skips it. "
    "Its prompt: the --dataset's first, else 32 random tokens.")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", min=1, help="torch threads (default: torch's).")]
PeakOpt = Annotated[int, typer.Option("--peak-matmul-size", min=16, help="N of the N^3 matmul timed for the peak.")]
BandwidthOpt = Annotated[int, typer.Option("--bandwidth-mib", min=1, help="Size of the tensor summed for the bandwidth.")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")]
SpecOpt = Annotated[Optional[str], typer.Option(
    "--speculative-config", metavar="JSON",
    help="Also run our engine with this speculative_config (vLLM's dict as JSON), beside the plain run, and vLLM "
    "with it too: acceptance rate, mean acceptance length and per-position acceptance are reported, the ratio "
    "to the plain run is a column, and the outputs are checked to be the plain run's tokens.")]
WorkloadOpt = Annotated[str, typer.Option(
    "--workload", help="random (--input-len/--output-len), prefix-repetition (--prefix-repetition, --num-requests) "
    "or multi-turn (--multi-turn); --dataset overrides it.")]
PrefixRepOpt = Annotated[tuple[int, int, int, int], typer.Option(
    "--prefix-repetition", metavar="PREFIXES PREFIX_LEN SUFFIX_LEN OUTPUT_LEN",
    help="--workload prefix-repetition (vLLM's shape): shared random prefixes, each request with its own suffix.")]
MultiTurnOpt = Annotated[tuple[int, int, int, int], typer.Option(
    "--multi-turn", metavar="CONVERSATIONS TURNS USER_LEN REPLY_LEN",
    help="--workload multi-turn: each turn's prompt is its conversation so far plus a new message, turn after "
    "turn across the conversations. Without --kv-cache-gib the device KV cache is a third of the working set.")]
VariantOpt = Annotated[Optional[list[str]], typer.Option(
    "--variant", metavar="JSON",
    help='Also run our engine with these EngineConfig fields beside the first run, e.g. \'{"enable_prefix_caching": '
    'false}\' or \'{"kv_offloading_size": 2}\'; the ratio to the first run is a column. Repeatable.')]
VLLMPrefixOpt = Annotated[bool, typer.Option(
    "--vllm-prefix-caching/--no-vllm-prefix-caching", help="vLLM's enable_prefix_caching.")]
BracketOpt = Annotated[bool, typer.Option(
    "--bracket/--no-bracket",
    help="With a peer: time our engine again after the peers (same engine, no second start-up) and report "
    "both runs as one, so a machine that speeds up or slows down during the bench moves both sides alike.")]


@bench_app.command(cls=GroupedHelpCommand)
def throughput(
    model: ModelOpt = None,
    model_shape: ShapeOpt = None,
    num_requests: NumOpt = 64,
    input_len: InOpt = (32, 256),
    output_len: OutOpt = (32, 256),
    seed: SeedOpt = 0,
    dataset: DatasetOpt = None,
    temperature: TemperatureOpt = 0.0,
    dtype: DtypeOpt = "auto",
    eager: EagerOpt = False,
    both: BothOpt = False,
    peer: PeerOpt = None,
    peer_python: PeerPyOpt = None,
    hf_batch_size: HFBatchOpt = 16,
    vllm_eager: VLLMEagerOpt = False,
    max_num_seqs: SeqsOpt = 256,
    max_num_batched_tokens: TokensOpt = 2048,
    kv_cache_gib: KVOpt = None,
    decode_tokens: DecodeOpt = 128,
    threads: ThreadsOpt = None,
    speculative_config: SpecOpt = None,
    workload: WorkloadOpt = "random",
    prefix_repetition: PrefixRepOpt = (4, 1024, 64, 32),
    multi_turn: MultiTurnOpt = (16, 4, 128, 32),
    variant: VariantOpt = None,
    vllm_prefix_caching: VLLMPrefixOpt = True,
    json_path: JsonOpt = None,
    profile: Annotated[Optional[Path], typer.Option(
        "--profile", dir_okay=False,
        help="After the timed run, run the first --profile-requests requests again under torch.profiler (untimed) "
        "and write the op table here.")] = None,
    profile_requests: Annotated[int, typer.Option("--profile-requests", min=1, help="Requests of the profiled run.")] = 16,
    peak_matmul_size: PeakOpt = 2048,
    bandwidth_mib: BandwidthOpt = 512,
    progress: ProgressOpt = True,
    bracket: BracketOpt = True,
    verbose: VerboseOpt = False,
):
    """Offline throughput: all requests at once; requests/s, output tokens/s, total tokens/s."""
    _run("throughput", locals())


@bench_app.command(cls=GroupedHelpCommand)
def latency(
    model: ModelOpt = None,
    model_shape: ShapeOpt = None,
    num_requests: NumOpt = 64,
    input_len: InOpt = (32, 256),
    output_len: OutOpt = (32, 256),
    seed: SeedOpt = 0,
    dataset: DatasetOpt = None,
    temperature: TemperatureOpt = 0.0,
    concurrency: Annotated[int, typer.Option(
        "--concurrency", "-c", min=1, help="Requests in flight: a new one is added when one finishes.")] = 8,
    dtype: DtypeOpt = "auto",
    eager: EagerOpt = False,
    both: BothOpt = False,
    peer: PeerOpt = None,
    peer_python: PeerPyOpt = None,
    vllm_eager: VLLMEagerOpt = False,
    max_num_seqs: SeqsOpt = 256,
    max_num_batched_tokens: TokensOpt = 2048,
    kv_cache_gib: KVOpt = None,
    decode_tokens: DecodeOpt = 128,
    threads: ThreadsOpt = None,
    speculative_config: SpecOpt = None,
    workload: WorkloadOpt = "random",
    prefix_repetition: PrefixRepOpt = (4, 1024, 64, 32),
    multi_turn: MultiTurnOpt = (16, 4, 128, 32),
    variant: VariantOpt = None,
    vllm_prefix_caching: VLLMPrefixOpt = True,
    json_path: JsonOpt = None,
    peak_matmul_size: PeakOpt = 2048,
    bandwidth_mib: BandwidthOpt = 512,
    progress: ProgressOpt = True,
    bracket: BracketOpt = True,
    verbose: VerboseOpt = False,
):
    """Latency at a fixed concurrency: TTFT, TPOT and ITL (mean, median, P99) as vLLM's bench serve defines them."""
    _run("latency", locals())


bench_app.command("disagg", cls=GroupedHelpCommand)(disagg)
bench_app.command("serve", cls=GroupedHelpCommand)(serve)
bench_app.command("suite", cls=GroupedHelpCommand)(suite)
bench_app.command("table", cls=GroupedHelpCommand)(table)


# --- the run ---------------------------------------------------------------------------------------


def _fail(message: str) -> None:
    Console(stderr=True).print(f"error: {message}", soft_wrap=True, markup=False, highlight=False, style="red")
    raise typer.Exit(2)


def _run(command: str, o: dict) -> None:
    import torch
    from toolkit.config import load_model_config, resolve_dtype

    peers = list(dict.fromkeys(o["peer"] or []))
    bad = [p for p in peers if p not in PEERS]
    if bad:
        _fail(f"unknown --peer {', '.join(bad)}; choose from {', '.join(PEERS)}")
    if "vllm" in peers and o["peer_python"] is None:
        _fail("--peer vllm needs --peer-python PATH (the python of an environment with vLLM installed)")
    if o["input_len"][0] > o["input_len"][1] or o["output_len"][0] > o["output_len"][1] or min(*o["input_len"], *o["output_len"]) < 1:
        _fail("--input-len and --output-len take MIN MAX with 1 <= MIN <= MAX")
    greedy = o["temperature"] == 0  # sampled runs' tokens differ run to run: they are not compared
    if o["threads"]:
        torch.set_num_threads(o["threads"])
    variants = _variants(o["variant"])
    if command != "throughput" and any(_pipelined(v) for v in variants):
        _fail("a --variant with pipeline_parallel_size runs in `toolkit bench throughput` only")
    if any(v.get("prefill_instances") or v.get("decode_instances") for v in variants):
        _fail("disaggregated prefill/decode runs as several processes with its own workload and report: "
              "`toolkit bench disagg --layout P:D` (against colocated replicas on the same ranks)")
    if o["workload"] not in WORKLOADS:
        _fail(f"unknown --workload {o['workload']}; choose from {', '.join(WORKLOADS)}")
    spec = None
    if o["speculative_config"] is not None:
        from toolkit.cli.options import parse_speculative_config
        from toolkit.cli.errors import CliError

        try:
            spec = parse_speculative_config(o["speculative_config"], o["model"])
        except CliError as e:
            _fail(str(e))
    try:
        model_path, load_format = resolve_model(o["model"], o["model_shape"], need_weights=bool(peers))
        mc = load_model_config(model_path)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    dtype = resolve_dtype(o["dtype"], mc.checkpoint_dtype)
    dtype_name = str(dtype).removeprefix("torch.")

    try:
        requests = _workload(o, model_path, mc)
    except ValueError as e:
        _fail(str(e))
    decode_req = None
    if o["decode_tokens"] and o["dataset"] is not None:
        # A dataset's own text: what a model (and a draft, or n-gram lookup) sees in that workload.
        decode_req = BenchRequest(requests[0].prompt_token_ids, o["decode_tokens"])
    elif o["decode_tokens"]:
        decode_req = random_workload(1, (32, 32), (o["decode_tokens"],) * 2, mc.vocab_size, seed=o["seed"] + 1)[0]
    warm = BenchRequest(requests[0].prompt_token_ids, 2)
    longest = max(r.prompt_len + r.output_len for r in requests + ([decode_req] if decode_req else []))
    max_model_len = min(mc.max_position_embeddings, math.ceil(longest / BLOCK) * BLOCK)
    if longest > mc.max_position_embeddings:
        _fail(f"a request needs {longest} tokens, more than the model's max_position_embeddings {mc.max_position_embeddings}")
    bytes_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * dtype_bytes(dtype)
    if o["kv_cache_gib"] is not None:
        kv_bytes = int(o["kv_cache_gib"] * 2**30)
    elif o["workload"] == "multi-turn" and o["dataset"] is None:
        # The point of the workload: a working set 3x the device cache (the tiers hold the rest).
        need = max(math.ceil((r.prompt_len + r.output_len) / BLOCK) for r in requests)
        blocks = max(math.ceil(workload_summary(requests)["distinct_prompt_tokens"] / 3 / BLOCK), 2 * need)
        kv_bytes = blocks * BLOCK * bytes_per_token
    else:  # every request resident at once (no preemption), at most vLLM's 4 GiB
        # With speculation, room for 1 + k tokens a step and a draft model's k lookahead slots too.
        extra = 2 * spec.k if spec is not None else 0
        blocks = sum(math.ceil((r.prompt_len + r.output_len + extra) / BLOCK) for r in requests) + 1
        kv_bytes = min(blocks * BLOCK * bytes_per_token, 4 * 2**30)

    err = Console(stderr=True)
    machine = machine_info()
    err.print(f"[dim]measuring the roofline: {dtype_name} matmul peak and memory bandwidth...[/]")
    probe = lambda: memory_bandwidth(o["bandwidth_mib"] * 2**20)  # noqa: E731
    peak = matmul_peak(dtype, n=o["peak_matmul_size"])
    bandwidth = probe()
    # The other dtype's peak too: which dtype is this CPU's fast path is worth seeing next to the figures.
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    other_peak = matmul_peak(other, n=o["peak_matmul_size"])

    ours_modes = ["compiled", "eager"] if o["both"] else (["eager"] if o["eager"] else ["compiled"])
    bracket = bool(o["bracket"] and peers)
    kept = []  # our systems, kept to be timed again after the peers when bracketing
    first_raw: dict[str, tuple | None] = {}
    concurrency = o.get("concurrency") or 0
    results: dict[str, dict] = {}
    ours_labels, peer_labels = [], []
    plain_runs, pairs = {}, []  # with --speculative-config: each plain run's (label, tokens); (speculative, plain) labels
    profile_result = None
    partial = Path(f"{o['json_path']}.partial") if o["json_path"] else None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, disable=not o["progress"], transient=False) as bar:

        def phase(description: str, total: int):
            task = bar.add_task(description, total=total)
            return lambda n=1: bar.update(task, advance=n)

        def startup(label: str, start):
            advance = phase(f"{label}: start-up (load + compile + warm-up)", 1)
            out = start()
            advance(1)
            return out

        try:
            runs = [(m, v, None) for m in ours_modes for v in ([None, spec] if spec else [None])]
            runs += [(m, None, args) for m in ours_modes for args in variants]
            for mode, variant, engine_args in runs:
                if _pipelined(engine_args):
                    from toolkit.parallel.pipeline import head_layers as pipeline_head_layers

                    label = f"toolkit ({mode}" + "".join(f", {k}={v}" for k, v in engine_args.items()) + ")"
                    system = PipelineSystem(label, model_path, dict(
                        load_format=load_format, dtype=dtype_name, eager=mode == "eager", max_model_len=max_model_len,
                        kv_cache_memory_bytes=kv_bytes, max_num_seqs=o["max_num_seqs"],
                        max_num_batched_tokens=o["max_num_batched_tokens"], temperature=o["temperature"]), engine_args,
                        _threads_per_rank(o, engine_args))
                    raw = system.throughput(requests, warm, phase)
                    res = results[label] = {"kind": "ours", "startup": raw["startup"], "throughput": raw["throughput"]}
                    res["pipeline"] = {"stages": raw["stages"], "threads_per_rank": system.spec["threads"],
                                       "bubble_model": bubble_model(raw["stages"], mc.num_layers, _tokens_fed(requests),
                                                                    raw["throughput"]["output_tokens"],
                                                                    head_layers=pipeline_head_layers(mc))}
                    plain_label, plain_tokens = plain_runs[mode]
                    res["tokens_identical_to_plain"] = raw["tokens"] == plain_tokens.get("throughput") if greedy else None
                    pairs.append((label, plain_label))
                    _say(bar, label, res, partial, results)
                    ours_labels.append(label)
                    continue
                system = OursSystem(model_path, load_format=load_format, dtype=dtype_name, eager=mode == "eager",
                                    max_model_len=max_model_len, kv_cache_memory_bytes=kv_bytes,
                                    max_num_seqs=o["max_num_seqs"], max_num_batched_tokens=o["max_num_batched_tokens"],
                                    speculative_config=variant, engine_args=engine_args, temperature=o["temperature"])
                res = {"kind": "ours", "startup": startup(system.label, lambda: system.start(warm))}
                if (engine_args or {}).get("quantization") == "int8":
                    res["weight_bytes"] = 1  # what a decode step reads per weight
                with _counted(system, res, command):
                    first_raw[system.label] = _run_mode(command, system, requests, concurrency, phase, res)
                if decode_req:
                    with _counted(system, res, "decode"):
                        res["decode_timing"], res["decode_bandwidth"] = _beside(probe, lambda: system.decode(decode_req, phase))
                if variant is not None or engine_args is not None:
                    plain_label, plain_tokens = plain_runs[mode]
                    res["tokens_identical_to_plain"] = system.tokens == plain_tokens if greedy else None
                    pairs.append((system.label, plain_label))
                else:
                    plain_runs[mode] = (system.label, system.tokens)
                if command == "throughput" and o.get("profile") and profile_result is None:
                    profile_result = system.profile(requests[: o["profile_requests"]], phase)
                    profile_result["system"] = system.label
                results[system.label] = res
                _say(bar, system.label, res, partial, results)
                ours_labels.append(system.label)
                if bracket:
                    kept.append(system)
                del system
                gc.collect()
            if "hf" in peers:
                system = HFSystem(model_path, dtype=dtype, batch_size=o.get("hf_batch_size") or 16,
                                  temperature=o["temperature"])
                res = {"kind": "peer", "startup": startup(system.label, lambda: system.start(warm))}
                _run_mode(command, system, requests, concurrency, phase, res)
                if decode_req:
                    res["decode_timing"], res["decode_bandwidth"] = _beside(probe, lambda: system.decode(decode_req, phase))
                results[system.label] = res
                _say(bar, system.label, res, partial, results)
                peer_labels.append(system.label)
                del system
                gc.collect()
            if "vllm" in peers:
                system = VLLMSystem(model_path, python=python_of(o["peer_python"]), dtype=dtype_name,
                                    eager=o["vllm_eager"], max_model_len=max_model_len,
                                    max_num_seqs=o["max_num_seqs"], max_num_batched_tokens=o["max_num_batched_tokens"],
                                    speculative_config=_vllm_spec(spec), enable_prefix_caching=o["vllm_prefix_caching"],
                                    temperature=o["temperature"])
                raw = system.run(mode=command, requests=requests, warm=warm, concurrency=concurrency,
                                 decode=decode_req, phase=phase, probe=probe)
                res = {"kind": "peer", "startup": raw["startup"], "version": raw.get("version")}
                if command == "throughput":
                    res["throughput"] = raw["throughput"]
                else:
                    lat = raw["latency"]
                    res["latency"] = latency_metrics(lat["timings"], lat["duration_s"])
                    res["latency"]["concurrency"] = concurrency
                if raw.get("decode"):
                    res["decode_timing"], res["decode_bandwidth"] = raw["decode"], raw.get("decode_bandwidth")
                label = f"vLLM {raw.get('version', '')}".strip() + (f" ({spec.method} k={spec.k})" if spec else "")
                if raw.get("spec_decode"):
                    res["spec_decode"] = {command: raw["spec_decode"]}
                if raw.get("kv_cache"):
                    res["kv_cache"] = {command: kv_delta(raw["kv_cache"], {})}
                results[label] = res
                _say(bar, label, res, partial, results)
                peer_labels.append(label)
            for system in reversed(kept):  # mirror order: the last to run before the peers runs first after
                again = {}
                after = lambda description, total: phase(f"{description} (after the peers)", total)  # noqa: E731
                with _counted(system, results[system.label], command):
                    raw = _run_mode(command, system, requests, concurrency, after, again)
                if decode_req:
                    with _counted(system, results[system.label], "decode"):
                        again["decode_timing"], again["decode_bandwidth"] = _beside(probe, lambda: system.decode(decode_req, after))
                _merge_rounds(command, results[system.label], again, concurrency, (first_raw[system.label], raw))
                _say(bar, f"{system.label}, both runs", results[system.label], partial, results)
            kept.clear()
        except BenchError as e:
            bar.stop()
            _fail(str(e))

    err.print("[dim]measuring the roofline again (the best of both readings is the roofline)...[/]")
    peak = best_of_probes(peak, matmul_peak(dtype, n=o["peak_matmul_size"]))
    if other == torch.float32:  # it may be the roofline (compute_peak): the best of two readings, as the dtype's
        other_peak = best_of_probes(other_peak, matmul_peak(other, n=o["peak_matmul_size"]))
    # The probes beside the decode runs count too: the run's best reading is the best of them all.
    beside = [b for res in results.values() for b in _listed(res.get("decode_bandwidth")) if b is not None]
    bandwidth = best_of_probes(bandwidth, probe(), *beside)
    flops = workload_flops(mc, requests)
    roof = compute_peak(peak, other_peak)
    for res in results.values():
        elapsed = _get(res, "throughput", "elapsed_s") or _get(res, "latency", "duration_s")
        if elapsed:
            res["roofline"] = {"useful_flops": flops, "gflops_per_s": flops / elapsed / 1e9,
                               "peak_fraction_pct": 100 * flops / elapsed / roof["flops_per_s"]}
        timing, beside = res.pop("decode_timing", None), res.pop("decode_bandwidth", None)
        weight_bytes = res.pop("weight_bytes", None)
        d = decode_metrics(timing) if timing is not None else None
        if d is not None and d["decode_tokens_per_s"]:
            context = d["prompt_len"] + d["output_tokens"] / 2  # mean context over the decode steps
            d["bytes_per_token"] = decode_bytes_per_token(mc, dtype_bytes(dtype), context, weight_bytes)
            d.update(_bandwidth_fractions(d["bytes_per_token"], timing, beside, bandwidth))
            res["decode"] = d

    rows = build_rows(command, results, ours_labels, peer_labels, pairs)
    model_info = {"path": str(model_path), "shape": o["model_shape"], "load_format_ours": load_format,
                  "dtype": dtype_name, "num_parameters": mc.num_parameters,
                  "layer_linear_parameters": layer_linear_params(mc)}
    workload = workload_summary(requests) | {
        "source": str(o["dataset"]) if o["dataset"] else o["workload"], "seed": o["seed"],
        "prefix_repetition": list(o["prefix_repetition"]) if o["workload"] == "prefix-repetition" else None,
        "multi_turn": list(o["multi_turn"]) if o["workload"] == "multi-turn" else None,
        "input_len_range": list(o["input_len"]), "output_len_range": list(o["output_len"]), "greedy": greedy,
        "temperature": o["temperature"], "ignore_eos": True}
    settings = {"max_model_len": max_model_len, "kv_cache_bytes_ours": kv_bytes, "max_num_seqs": o["max_num_seqs"],
                "max_num_batched_tokens": o["max_num_batched_tokens"], "hf_batch_size": o.get("hf_batch_size"),
                "concurrency": concurrency or None, "decode_tokens": o["decode_tokens"], "vllm_eager": o["vllm_eager"],
                "bracket": bracket, "speculative_config": spec and spec.__dict__, "variants": variants,
                "vllm_prefix_caching": o["vllm_prefix_caching"]}
    roofline = {"matmul": peak, "matmul_other_dtype": other_peak, "compute_peak": roof, "bandwidth": bandwidth,
                "flops_formula": "per request (P prompt, O output, T=P+O-1 tokens fed): 2*T*P_layers "
                                 "+ 4*L*Hq*D*T(T+1)/2 + 2*O*V*H",
                "decode_bytes_formula": "(num_parameters - V*H if untied) * dtype_bytes + 2*L*Hkv*D*dtype_bytes*context"}
    caption = (f"{machine['cpu']}, {machine['cpu_count']} cores, torch {machine['torch']} ({machine['torch_threads']} threads), "
               f"transformers {machine['transformers']}; matmul peak {peak['flops_per_s'] / 1e9:.1f} GFLOP/s {dtype_name} "
               f"({other_peak['flops_per_s'] / 1e9:.1f} {other_peak['dtype']}"
               + (f"; the roofline is {roof['flops_per_s'] / 1e9:.1f}, from {roof['dtype']}" if roof is not peak else "")
               + "), "
               f"read bandwidth {bandwidth['read_bytes_per_s'] / 1e9:.1f} GB/s; model {mc.num_parameters:,} params "
               f"{dtype_name}; {len(requests)} requests, {workload['prompt_tokens']} prompt + {workload['output_tokens']} "
               f"output tokens" + (f"; concurrency {concurrency}" if command == "latency" else "")
               + ". Ratios are ours / peer."
               + (" Ours: two timed runs, before and after the peers, as one." if bracket else "")
               + (f" Sampled at temperature {o['temperature']:g}." if not greedy else "")
               + "".join(f" {a}: tokens {'identical to' if results[a]['tokens_identical_to_plain'] else 'DIFFERENT from'} "
                         f"{b}'s." for a, b in pairs if greedy))
    title = f"toolkit bench {command}"
    out = Console()
    if not out.is_terminal:
        out = Console(width=240)  # a file or a pipe: keep the table's rows on one line each
    out.print(render_table(rows, title, caption))
    for label, res in results.items():
        if "pipeline" in res:
            for line in report_lines(label, res["pipeline"], res["throughput"]["output_tokens_per_s"]):
                out.print(line, markup=False, highlight=False)
    if profile_result is not None:
        Path(o["profile"]).write_text(profile_result["table"])
        out.print(f"profile of {profile_result['system']} (top 10 by self CPU time; full table in {o['profile']}):")
        for e in profile_result["top"][:10]:
            out.print(f"  {e['self_cpu_pct']:5.1f}%  {e['self_cpu_ms']:9.1f} ms  {e['calls']:7d}x  {e['name']}",
                      markup=False, highlight=False)
    if partial is not None:
        partial.unlink(missing_ok=True)
    if o["json_path"]:
        doc = report_json(command, rows, machine=machine, roofline=roofline, model=model_info, workload=workload,
                          settings=settings, systems=results,
                          profile=profile_result and {"system": profile_result["system"], "top": profile_result["top"]})
        Path(o["json_path"]).write_text(json.dumps(doc, indent=2, default=str) + "\n")


class _counted:
    """Adds the speculative-decoding and KV-cache counters of the runs inside it to
    res["spec_decode"][run] and res["kv_cache"][run] (two runs of one system add up)."""

    def __init__(self, system, res: dict, run: str):
        self.system, self.res, self.run = system, res, run

    def __enter__(self):
        self.before = self.system.spec_counters(), self.system.kv_counters(), self.system.expert_counters()

    def __exit__(self, *exc):
        if exc[0] is not None:
            return
        for key, after, before, delta in (("spec_decode", self.system.spec_counters(), self.before[0], spec_delta),
                                          ("kv_cache", self.system.kv_counters(), self.before[1], kv_delta),
                                          ("experts", self.system.expert_counters(), self.before[2], expert_delta)):
            if before is None:
                continue
            total = self.res.setdefault(key, {}).get(self.run)
            d = delta(after, before)
            self.res[key][self.run] = d if total is None else delta(d, total, sign=-1)


WORKLOADS = ("random", "prefix-repetition", "multi-turn")


def _variants(texts: list[str] | None) -> list[dict]:
    """--variant JSON objects of EngineConfig fields, checked before anything loads."""
    from dataclasses import fields

    from toolkit.config import EngineConfig

    names = {f.name for f in fields(EngineConfig)} - {"model"}
    out = []
    for text in texts or []:
        try:
            args = json.loads(text)
        except json.JSONDecodeError as e:
            _fail(f"--variant {text!r} is not JSON: {e.msg}")
        if not isinstance(args, dict) or not args:
            _fail(f"--variant {text!r} must be a non-empty JSON object of EngineConfig fields")
        unknown = sorted(set(args) - names)
        if unknown:
            _fail(f"--variant: unknown EngineConfig field(s) {', '.join(unknown)}")
        out.append(args)
    return out


def _pipelined(engine_args: dict | None) -> bool:
    return bool(engine_args) and int(engine_args.get("pipeline_parallel_size", 1)) > 1


def _threads_per_rank(o: dict, engine_args: dict) -> int:
    """--threads, or the threads of a single-process run shared among the pipeline's processes."""
    import torch

    world = int(engine_args["pipeline_parallel_size"]) * int(engine_args.get("tensor_parallel_size", 1))
    return o["threads"] or max(1, torch.get_num_threads() // world)


def _tokens_fed(requests: list[BenchRequest]) -> int:
    """Tokens the model computes for the workload: each prompt, and every output token but the last."""
    return sum(r.prompt_len + r.output_len - 1 for r in requests)


def _vllm_spec(spec) -> dict | None:
    if spec is None:
        return None
    out = {"method": spec.method, "num_speculative_tokens": spec.k}
    if spec.method == "ngram":
        out.update(prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max)
    else:
        out["model"] = str(Path(spec.model).resolve())
    if spec.disable_by_batch_size is not None:
        out["disable_by_batch_size"] = spec.disable_by_batch_size
    return out


def _run_mode(command: str, system, requests, concurrency: int, phase, res: dict):
    """One timed run into res; in latency mode also returns its raw (timings, duration)."""
    if command == "throughput":
        res["throughput"] = system.throughput(requests, phase)
    else:
        timings, duration = system.latency(requests, concurrency, phase)
        res["latency"] = latency_metrics(timings, duration)
        res["latency"]["concurrency"] = concurrency
        return timings, duration
    return None


def _beside(probe, run):
    """run() between two bandwidth probes; returns its result and the best of the two readings."""
    before = probe()
    out = run()
    return out, best_of_probes(before, probe())


def _bandwidth_fractions(per_token: float, timing, beside, whole_run: dict) -> dict:
    """The decode runs' fraction of the whole run's best read bandwidth, and of the best reading
    beside each run (where that was probed: every system of ours and transformers, vLLM's worker
    when it waits for the probes)."""
    runs = _listed(timing)
    tokens_s = [(t.output_len - 1, t.e2el - t.ttft) for t in runs if t.output_len > 1]
    out = {"bandwidth_fraction_pct": bandwidth_fraction(per_token, [(n, s, whole_run["read_bytes_per_s"]) for n, s in tokens_s])}
    probes = _listed(beside)
    if probes and len(probes) == len(runs) and all(p is not None for p in probes):
        rates = [p["read_bytes_per_s"] for t, p in zip(runs, probes) if t.output_len > 1]
        out["bandwidth_beside"] = [{"read_bytes_per_s": p["read_bytes_per_s"], "samples": p["read_bytes_per_s_samples"]}
                                   for p in probes]
        out["bandwidth_fraction_beside_pct"] = bandwidth_fraction(per_token, [(n, s, r) for (n, s), r in zip(tokens_s, rates)])
    return out


def _listed(x) -> list:
    """A decode run's timing or probe, or a bracketed pair of them, as a list (None: none)."""
    return [] if x is None else x if isinstance(x, list) else [x]


def _merge_rounds(command: str, res: dict, again: dict, concurrency: int, raws: tuple) -> None:
    """Our two timed runs (before and after the peers) as one system's figures; see --bracket.
    raws: each run's (timings, duration) in latency mode."""
    if command == "throughput":
        res["throughput"] = combine_throughput([res["throughput"], again["throughput"]])
    else:
        (first, d1), (second, d2) = raws
        runs = [res["latency"], again["latency"]]
        res["latency"] = latency_metrics(first + second, d1 + d2)
        res["latency"]["concurrency"] = concurrency
        res["latency"]["runs"] = [{k: run[k] for k in ("duration_s", "output_tokens_per_s", "ttft_ms", "tpot_ms")}
                                  for run in runs]
    if "decode_timing" in again:
        res["decode_timing"] = [res["decode_timing"], again["decode_timing"]]
        res["decode_bandwidth"] = [res.get("decode_bandwidth"), again.get("decode_bandwidth")]


def _say(bar: Progress, label: str, res: dict, partial: Path | None = None, results: dict | None = None) -> None:
    """One line per finished system, so a long run shows its figures as they come."""
    parts = [f"start-up {res['startup']['total_s']:.1f} s"]
    if "throughput" in res:
        parts.insert(0, f"{res['throughput']['output_tokens_per_s']:.1f} output tok/s")
    if "latency" in res:
        lat = res["latency"]
        parts.insert(0, f"TTFT {lat['ttft_ms']['median']:.0f} ms, TPOT {lat['tpot_ms']['median']:.0f} ms (median)")
    timing = res.get("decode_timing")
    rate = decode_metrics(timing)["decode_tokens_per_s"] if timing is not None else 0.0
    if rate:
        parts.append(f"batch-1 decode {rate:.1f} tok/s")
    bar.console.print(f"{label}: " + ", ".join(parts), markup=False, highlight=False)
    if partial is not None and results is not None:  # a run killed later still leaves what it measured
        partial.write_text(json.dumps({"partial": True, "systems": results}, indent=2, default=str) + "\n")


def _get(d, *path):
    for key in path:
        if not isinstance(d, dict) or d.get(key) is None:
            return None
        d = d[key]
    return d


def _workload(o: dict, model_path: Path, mc) -> list[BenchRequest]:
    if o["dataset"] is None and o["workload"] == "prefix-repetition":
        return prefix_repetition_workload(*o["prefix_repetition"], o["num_requests"], mc.vocab_size, o["seed"])
    if o["dataset"] is None and o["workload"] == "multi-turn":
        return multi_turn_workload(*o["multi_turn"], mc.vocab_size, o["seed"])
    if o["dataset"] is None:
        return random_workload(o["num_requests"], tuple(o["input_len"]), tuple(o["output_len"]), mc.vocab_size, o["seed"])
    tokenize = None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        tokenize = lambda text: tok(text)["input_ids"]  # noqa: E731
    except Exception:  # noqa: BLE001 - a model without a tokenizer can still take token-id prompts
        pass
    default_out = (o["output_len"][0] + o["output_len"][1]) // 2
    requests = load_dataset(o["dataset"], tokenize, default_out, o["num_requests"])
    for i, r in enumerate(requests):
        bad = [t for t in r.prompt_token_ids if not 0 <= t < mc.vocab_size]
        if bad:
            raise ValueError(f"{o['dataset']}: request {i} has token ids outside the vocabulary: {bad[:5]}")
    return requests
