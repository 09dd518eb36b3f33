"""`toolkit info MODEL`: what a checkpoint is and how much of it fits where."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from toolkit.attention.kv_cache import kv_cache_bytes_per_token
from toolkit.cli import capacity as cap
from toolkit.cli import host_plan
from toolkit.cli.default_model import check_model_folder, resolve_model
from toolkit.cli.errors import CliError, exit_with, stderr_console
from toolkit.cli.options import VerboseOpt
from toolkit.cli.sizes import format_size, parse_size


def info(
    model: Annotated[Optional[Path], typer.Argument(
        help="Hugging Face model folder (config.json and *.safetensors) or a .gguf file. Default: the default model, SmolLM2-135M-Instruct.",
        show_default=False)] = None,
    memory: Annotated[Optional[list[int]], typer.Option(
        parser=parse_size, metavar="SIZE", show_default=False,
        help="Memory per GPU for weights + KV cache, e.g. 16GiB (repeatable). "
             f"Default: {', '.join(cap.DEFAULT_BUDGETS)}.")] = None,
    dtype: Annotated[str, typer.Option(help="Serving dtype for the capacity table: auto (the checkpoint's), "
                                            "float32, bfloat16, float16.")] = "auto",
    max_model_len: Annotated[Optional[int], typer.Option(
        min=1, show_default=False, help="Request length for the concurrency column. Default: max_position_embeddings.")] = None,
    block_size: Annotated[int, typer.Option(min=1, help="KV-cache block size (tokens are counted in whole blocks).")] = 16,
    tp: Annotated[Optional[int], typer.Option("--tp", min=1, show_default=False, help=(
        "With --pp/--dp: the one layout the host table shows. Default: every TP size, --dp 2 and --pp 2."))] = None,
    pp: Annotated[Optional[int], typer.Option("--pp", min=1, show_default=False, help="See --tp.")] = None,
    dp: Annotated[Optional[int], typer.Option("--dp", min=1, show_default=False, help="See --tp.")] = None,
    prefill_instances: Annotated[int, typer.Option(
        min=0, help="With --decode-instances: a disaggregated layout's host table, per role (--tp, --pp: the "
                    "decode instances' shape; --dp: replicas of each).")] = 0,
    decode_instances: Annotated[int, typer.Option(min=0, help="See --prefill-instances.")] = 0,
    prefill_tp: Annotated[Optional[int], typer.Option(
        min=1, show_default=False, help="TP size of the prefill instances. Default: --tp.")] = None,
    prefill_pp: Annotated[Optional[int], typer.Option(
        min=1, show_default=False, help="Pipeline stages of the prefill instances. Default: --pp.")] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Requests at once, for the host table.")] = 256,
    max_request_tokens: Annotated[Optional[int], typer.Option(
        min=1, show_default=False, help="The workload's longest request (prompt + output tokens), for the host "
                                        "table. Default: max_model_len.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    verbose: VerboseOpt = False,
):
    """Model size: parameters, weight and KV bytes, and what fits in a memory budget per TP size.

    Shows the architecture, the parameter count (cross-checked against the safetensors headers, or a
    GGUF file's tensors), the stored tensor types (a GGUF file's quantization types) with their counts,
    weight bytes per dtype, KV-cache bytes per token, and for each memory budget and each
    tensor-parallel size the model can be split into: the KV tokens and concurrent max_model_len requests
    that fit per GPU.

    Not counted: activations, CUDA graphs, the CUDA context (leave ~10% of the GPU for them)."""
    try:
        if model is None:  # the model `toolkit generate` runs without --model
            model = resolve_model(None, lambda message: None)
            stderr_console().print(f"no MODEL given: describing the default model, {escape(str(model))}",
                                   soft_wrap=True)
        report = build_report(model, memory or [parse_size(m) for m in cap.DEFAULT_BUDGETS], dtype,
                              max_model_len, block_size)
        layouts = None if (tp, pp, dp) == (None, None, None) else [(tp or 1, pp or 1, dp or 1)]
        # What a CPU run of each layout takes on this host (cli/host_plan.py).
        report["host"] = host_plan.for_model(model, dtype, layouts, block_size, max_num_seqs, max_model_len,
                                             max_request_tokens)
        if prefill_instances or decode_instances:
            if not (prefill_instances and decode_instances):
                raise CliError("--prefill-instances and --decode-instances go together (at least one of each)")
            # --dp: each decode instance's replicas, each a row's instance (what memory each one takes)
            report["disaggregated"] = _disaggregated(model, dtype, prefill_instances, decode_instances * (dp or 1),
                                                     (prefill_pp or pp or 1, prefill_tp or tp or 1),
                                                     (pp or 1, tp or 1), block_size, max_num_seqs, max_model_len,
                                                     max_request_tokens)
    except CliError as e:
        exit_with(e)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_report(report, Console())
        Console().print(host_plan.format_plan(report["host"]), soft_wrap=True, markup=False, highlight=False)
        if "disaggregated" in report:
            Console().print(host_plan.format_disaggregated(report["disaggregated"]), soft_wrap=True, markup=False,
                            highlight=False)


def _disaggregated(model: Path, dtype: str, prefill: int, decode: int, prefill_shape: tuple[int, int],
                   decode_shape: tuple[int, int], block_size: int, max_num_seqs: int, max_model_len: int | None,
                   max_request_tokens: int | None) -> dict:
    """Each role's host row; its (pp, tp) shape checked against the model's layers and heads."""
    from toolkit.config import load_model_config, resolve_dtype
    from toolkit.parallel import ParallelConfigError
    from toolkit.parallel.pipeline import layer_partition
    from toolkit.parallel.tensor_parallel import check_tensor_parallel

    config = load_model_config(model)
    for role, (pp, tp) in (("prefill", prefill_shape), ("decode", decode_shape)):
        try:
            check_tensor_parallel(config, tp)
            layer_partition(config.num_layers, pp)
        except ParallelConfigError as e:
            raise CliError(f"{role} instances: {e}") from None
    (ppp, ptp), (dpp, dtp) = prefill_shape, decode_shape
    return host_plan.disaggregated_plan(config, resolve_dtype(dtype, config.checkpoint_dtype), prefill, decode,
                                        ptp, dtp, block_size, max_num_seqs,
                                        max_model_len or config.max_position_embeddings, max_request_tokens,
                                        prefill_pp=ppp, decode_pp=dpp)


def build_report(path: Path, budgets: list[int], dtype: str, max_model_len: int | None, block_size: int) -> dict:
    from toolkit.config import load_model_config, resolve_dtype

    check_model_folder(path)
    try:
        config = load_model_config(path)
        serving_dtype = resolve_dtype(dtype, config.checkpoint_dtype)
        stored = cap.checkpoint_size(config)
    except (OSError, ValueError) as e:
        raise CliError(f"cannot read model {path}: {e}") from None
    length = max_model_len or config.max_position_embeddings
    rows = cap.capacity_table(config, serving_dtype, budgets, block_size, length)
    return {
        "model": str(path),
        "architecture": config.architecture,
        "family": config.family,
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "checkpoint_dtype": _name(config.checkpoint_dtype),
        "num_parameters": config.num_parameters,
        # Mixture-of-experts models compute each token with their top_k routed experts only.
        "num_active_parameters": config.num_active_parameters,
        "num_experts": None if config.moe is None else config.moe.num_experts,
        "num_experts_per_tok": None if config.moe is None else config.moe.top_k,
        "moe_intermediate_size": None if config.moe is None else config.moe.intermediate_size,
        "num_sparse_layers": None if config.moe is None else sum(config.moe.sparse_layers),
        "checkpoint_parameters": stored.parameters,
        "parameters_match": stored.parameters == config.num_parameters,
        "checkpoint_bytes": stored.bytes,
        "checkpoint_tensor_dtypes": stored.dtypes,
        "checkpoint_tensors_per_dtype": stored.tensors_per_dtype,  # a GGUF file's quantization types, counted
        "weight_bytes": {name: config.num_parameters * dt.itemsize for name, dt in cap.WEIGHT_DTYPES.items()},
        "dtype": _name(serving_dtype),
        "kv_bytes_per_token": kv_cache_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim,
                                                       serving_dtype),
        "block_size": block_size,
        "max_model_len": length,
        "capacity": [row.as_dict() for row in rows],
    }


def print_report(r: dict, console: Console) -> None:
    match = "matches the checkpoint" if r["parameters_match"] else \
        f"[red]checkpoint tensors hold {r['checkpoint_parameters']:,}[/red]"
    lines = [
        f"[bold]{escape(r['model'])}[/bold]: {r['architecture']} ({r['family']})",
        f"  layers {r['num_layers']}, hidden {r['hidden_size']}, intermediate {r['intermediate_size']}, "
        f"vocab {r['vocab_size']}, max positions {r['max_position_embeddings']}",
        f"  heads {r['num_heads']}, kv heads {r['num_kv_heads']}, head_dim {r['head_dim']}, "
        f"tied embeddings {'yes' if r['tie_word_embeddings'] else 'no'}",
        f"  parameters {r['num_parameters']:,} ({match}); stored as "
        f"{', '.join(f'{n} {k}' for k, n in r['checkpoint_tensors_per_dtype'].items())} tensors, "
        f"{format_size(r['checkpoint_bytes'])}",
        "  weights " + ", ".join(f"{k} {format_size(v)}" for k, v in r["weight_bytes"].items()),
        f"  KV cache {r['kv_bytes_per_token']:,} bytes/token in {r['dtype']} "
        f"({format_size(r['kv_bytes_per_token'] * r['max_model_len'])} per {r['max_model_len']}-token request)",
    ]
    if r["num_experts"] is not None:
        lines.insert(4, f"  experts {r['num_experts']}, {r['num_experts_per_tok']} per token, expert intermediate "
                        f"{r['moe_intermediate_size']}, in {r['num_sparse_layers']} of {r['num_layers']} layers; "
                        f"active parameters per token {r['num_active_parameters']:,} of {r['num_parameters']:,}")
    for line in lines:
        console.print(line, soft_wrap=True, highlight=False)  # long lines wrap in the terminal, never cut
    title, header, rows = _capacity(r)
    if not console.is_terminal:  # a file or a pipe: aligned plain text, for grep and diff
        console.print(_plain_table(title, header, rows), soft_wrap=True, markup=False, highlight=False)
        return
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1))
    for name in header:
        table.add_column(name, justify="right", no_wrap=True, min_width=len(name))
    for row in rows:
        table.add_row(*[f"[red]{c}[/red]" if c == NO_FIT else c for c in row])
    # Wider than the terminal rather than a number cut to "…": the terminal wraps, nothing is lost.
    width = max(console.width, Measurement.get(console, console.options.update_width(10_000), table).maximum)
    Console(file=console.file, width=width, force_terminal=True, color_system=console.color_system).print(table)


NO_FIT = "does not fit"


def _capacity(r: dict) -> tuple[str, list[str], list[list[str]]]:
    """The capacity table's title, header and cells; every column but memory and TP is per rank (per GPU)."""
    title = f"Per GPU, {r['dtype']}, block size {r['block_size']}, requests of {r['max_model_len']:,} tokens"
    header = ["memory", "TP", "kv heads", "weights", "KV memory", "KV B/token", "tokens", "requests"]
    rows = []
    for row in r["capacity"]:
        cells = [format_size(row["memory_bytes"]), str(row["tp"]), str(row["kv_heads_per_rank"]),
                 format_size(row["weight_bytes_per_rank"])]
        if row["fits"]:
            cells += [format_size(row["kv_bytes_per_rank"]), f"{row['kv_bytes_per_token_per_rank']:,}",
                      f"{row['tokens']:,}", f"{row['requests_at_max_model_len']:,}"]
        else:
            cells += [NO_FIT, f"{row['kv_bytes_per_token_per_rank']:,}", "-", "-"]
        rows.append(cells)
    return title, header, rows


def _plain_table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c) for c in column) for column in zip(header, *rows)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in (header, *rows)]
    return "\n".join([title, *lines])


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")
