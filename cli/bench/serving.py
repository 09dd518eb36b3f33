"""`toolkit bench serve`: online serving, as vLLM's `vllm bench serve` measures it, against our server and
`vllm serve` started one after the other on the same machine.

Each server gets the same seeded random workload (token-id prompts, greedy, EOS ignored, so every
request makes exactly its output length) sent as streaming `/v1/completions` requests at Poisson
arrival times (`--request-rate` requests/s; inf: all at once), at most `--max-concurrency` in flight.
Every streamed chunk is one timing point (cli/bench/metrics.py: TTFT, TPOT, ITL, E2EL); the usage
block gives the token count. Goodput is the rate of requests that met every SLO given (`--goodput
ttft:MS tpot:MS e2el:MS`, vLLM's form).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer

from toolkit.cli.bench.metrics import RequestTiming, latency_metrics
from toolkit.cli.bench.workload import BenchRequest, random_workload

SLO_KEYS = ("ttft", "tpot", "e2el")
START_TIMEOUT_S = 900  # vLLM's CPU build compiles for minutes at start


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of a Poisson process at `rate` requests/s: exponential gaps,
    seeded; the first request at 0. An infinite rate sends everything at once."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 (inf: all at once), got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def parse_goodput(texts: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    slo = {}
    for text in texts or ():
        key, _, value = text.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if key not in SLO_KEYS or ms <= 0:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(SLO_KEYS)} and MS > 0, got {text!r}")
        slo[key] = ms / 1000.0
    return slo


def meets(timing: RequestTiming, slo: dict[str, float]) -> bool:
    values = {"ttft": timing.ttft, "tpot": timing.tpot or 0.0, "e2el": timing.e2el}
    return all(values[key] <= limit for key, limit in slo.items())


def serving_metrics(timings: list[RequestTiming], duration_s: float, slo: dict[str, float]) -> dict:
    """latency_metrics (with p50 = the median) plus goodput: requests/s that met every SLO."""
    out = latency_metrics(timings, duration_s, percentiles=(50, 99))
    good = sum(1 for t in timings if t.chunks and meets(t, slo))
    out["failed"] = sum(1 for t in timings if not t.chunks)
    out["good_requests"] = good
    out["goodput_requests_per_s"] = good / duration_s if duration_s > 0 else 0.0
    return out


# --- the client -------------------------------------------------------------------------------------


async def _one(client, url: str, model: str, request: BenchRequest, timing: RequestTiming) -> None:
    body = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    usage = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return  # a failed request: no chunks
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                timing.add(time.perf_counter(), 1)
    if timing.chunks and usage > timing.output_len:  # chunks that carried several tokens: the last one takes the rest
        when, n = timing.chunks[-1]
        timing.chunks[-1] = (when, n + usage - timing.output_len)


async def run_clients(url: str, model: str, requests: list[BenchRequest], arrivals: list[float],
                      max_concurrency: int | None) -> tuple[list[RequestTiming], float]:
    """Send every request at its arrival time (waiting for a free slot under max_concurrency)."""
    import httpx

    limit = asyncio.Semaphore(max_concurrency or len(requests))
    timings = [RequestTiming(0.0, r.prompt_len) for r in requests]
    start = time.perf_counter()

    async def send(i: int, client) -> None:
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        async with limit:
            timings[i].arrival = time.perf_counter()
            await _one(client, url, model, requests[i], timings[i])

    limits = httpx.Limits(max_connections=max_concurrency or len(requests))
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        await asyncio.gather(*(send(i, client) for i in range(len(requests))))
    return timings, time.perf_counter() - start


# --- the servers ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started for the bench, stopped with SIGTERM."""

    def __init__(self, name: str, argv: list[str], port: int):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile("w+")  # not a pipe: a server's logs would fill it and block it
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, text=True, env={**os.environ})

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log.read()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer /health within {START_TIMEOUT_S} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def ours_argv(model: Path, port: int, dtype: str, max_num_seqs: int, eager: bool) -> list[str]:
    argv = [sys.executable, "-m", "toolkit.cli.main", "serve", str(model), "--port", str(port), "--dtype", dtype,
            "--max-num-seqs", str(max_num_seqs), "--max-waiting", str(10**6)]
    return argv + (["--eager"] if eager else [])


def vllm_argv(python: Path, model: Path, port: int, dtype: str, max_num_seqs: int, eager: bool) -> list[str]:
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
            "--dtype", dtype, "--max-num-seqs", str(max_num_seqs), "--served-model-name", str(model)]
    return argv + (["--enforce-eager"] if eager else [])


# --- the command ------------------------------------------------------------------------------------


def serve(
    model: Annotated[Path, typer.Option("--model", "-m", help="Hugging Face model folder.", file_okay=False)],
    request_rate: Annotated[Optional[list[float]], typer.Option(
        "--request-rate", help="Poisson arrival rate, requests/s (inf: all at once). Repeatable: one run each.")] = None,
    max_concurrency: Annotated[Optional[int], typer.Option(
        "--max-concurrency", min=1, help="Most requests in flight (default: no limit).")] = None,
    num_requests: Annotated[int, typer.Option("--num-requests", min=1, help="Requests per run.")] = 64,
    input_len: Annotated[tuple[int, int], typer.Option("--input-len", help="Prompt length range MIN MAX.")] = (32, 256),
    output_len: Annotated[tuple[int, int], typer.Option("--output-len", help="Output length range MIN MAX.")] = (32, 256),
    seed: Annotated[int, typer.Option("--seed", help="Workload and arrival seed.")] = 0,
    goodput: Annotated[Optional[list[str]], typer.Option(
        "--goodput", metavar="KEY:MS", help="An SLO for goodput: ttft, tpot or e2el, in ms. Repeatable.")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Model dtype, for both servers.")] = "auto",
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", min=1, help="Requests per step, both servers.")] = 256,
    eager: Annotated[bool, typer.Option("--eager", help="Both servers without compilation.")] = False,
    url: Annotated[Optional[str], typer.Option(
        "--url", help="Measure a server already running at this address instead of starting ours.")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(
        "--served-model-name", help="The model's name in requests (default: --model as given, as the servers "
        "started here are named).")] = None,
    peer_python: Annotated[Optional[Path], typer.Option(
        "--peer-python", envvar="TOOLKIT_BENCH_VLLM_PYTHON",
        help="Python (or venv) with vLLM: `vllm serve` is measured after ours, on the same workload.")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", dir_okay=False, help="Also write the report here.")] = None,
):
    """Online serving: TTFT/TPOT/ITL/E2E p50/p99, throughput and goodput at Poisson arrival rates, against
    our server and `vllm serve` (with --peer-python), started one after the other."""
    from toolkit.cli.bench.systems import python_of
    from toolkit.cli.errors import CliError, exit_with
    from toolkit.config import load_model_config

    try:
        slo = parse_goodput(goodput)
        rates = request_rate or [math.inf]
        vocab = load_model_config(str(model)).vocab_size
        requests = random_workload(num_requests, input_len, output_len, vocab, seed)
        arrivals = {rate: poisson_arrivals(num_requests, rate, seed) for rate in rates}
    except (OSError, ValueError) as e:
        exit_with(CliError(str(e)))
    systems = [("toolkit", None)] if url is None else [("given", url)]
    if peer_python is not None:
        systems.append(("vllm", None))
    report = {"workload": {"num_requests": num_requests, "input_len": list(input_len), "output_len": list(output_len),
                           "seed": seed, "max_concurrency": max_concurrency, "slo_s": slo}, "runs": []}
    for name, address in systems:
        server = None
        if address is None:
            port = free_port()
            argv = (ours_argv(model, port, dtype, max_num_seqs, eager) if name == "toolkit"
                    else vllm_argv(python_of(peer_python), model, port, dtype, max_num_seqs, eager))
            server = ServerProcess(name, argv, port)
            server.wait_ready()
            address = server.url
        try:
            for rate in rates:
                timings, duration = asyncio.run(run_clients(address, served_model_name or str(model), requests,
                                                            arrivals[rate], max_concurrency))
                result = {"system": name, "request_rate": rate, **serving_metrics(timings, duration, slo)}
                report["runs"].append(result)
                typer.echo(summary_line(result), err=True)
        finally:
            if server is not None:
                server.stop()
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2, default=str))


def summary_line(r: dict) -> str:
    return (f"{r['system']} @ {r['request_rate']} req/s: {r['completed']} done, {r['failed']} failed, "
            f"{r['output_tokens_per_s']:.1f} out tok/s, {r['requests_per_s']:.2f} req/s, "
            f"goodput {r['goodput_requests_per_s']:.2f} req/s; "
            f"TTFT p50/p99 {r['ttft_ms']['p50']:.1f}/{r['ttft_ms']['p99']:.1f} ms, "
            f"TPOT {r['tpot_ms']['p50']:.1f}/{r['tpot_ms']['p99']:.1f}, ITL {r['itl_ms']['p50']:.1f}/"
            f"{r['itl_ms']['p99']:.1f}, E2E {r['e2el_ms']['p50']:.1f}/{r['e2el_ms']['p99']:.1f}")
