"""The systems a benchmark runs: our engine, Hugging Face transformers, and vLLM in its own environment.

Each system is started (its start-up timed: construct + one warm-up request of 2 tokens), then runs
the workload in one mode, and optionally a batch-1 decode run. Results are raw (elapsed times,
token counts, per-request `RequestTiming`s) so that every figure is computed by the same code for
every system (`toolkit.cli.bench.metrics`).

How per-token times are measured, from the outside, the same way for all:
- ours: after every `Engine.step()`, one timestamp; each in-flight request's output length is read
  (finished ones from the returned `RequestOutput`, running ones from `Engine.request_output_len`);
  a request whose length grew got a chunk at that timestamp. Start-up figures come from `Engine.stats()`.
- transformers: a streamer's `put()` is called by `generate` once per decoding step with that
  step's tokens; one timestamp per call. A request's k-th token is the k-th step's, and its tokens
  past its own output length (generated only because the batch runs to its longest request) are
  ignored.
- vLLM: `LLMEngine.add_request` / `step()` with DELTA outputs (cli/bench/vllm_worker.py): one
  timestamp after each step, a chunk per request that got tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from toolkit.cli.bench.metrics import RequestTiming, throughput_metrics
from toolkit.cli.bench.roofline import best_of_probes
from toolkit.cli.bench.workload import BenchRequest, hf_batches

Advance = Callable[[int], None]
# phase(description, total) -> advance(n): a progress bar task; the default draws nothing.
Phase = Callable[[str, int], Advance]


def no_progress(description: str, total: int) -> Advance:
    return lambda n=1: None


class BenchError(RuntimeError):
    """A system failed to run the workload; the message says why."""


# --- ours ------------------------------------------------------------------------------------------


class OursSystem:
    name = "toolkit"

    def __init__(self, model: Path, *, load_format: str, dtype: str, eager: bool, max_model_len: int,
                 kv_cache_memory_bytes: int | None, max_num_seqs: int, max_num_batched_tokens: int,
                 speculative_config=None, engine_args: dict | None = None, temperature: float = 0.0):
        """`engine_args`: more EngineConfig fields (a --variant), named in the label. `temperature`: 0
        is greedy; above, every request samples at it (unseeded)."""
        # A variant's fields win over the bench's own (e.g. its max_num_batched_tokens).
        self.kwargs = {**dict(dtype=dtype, enforce_eager=eager, skip_tokenizer_init=True, load_format=load_format,
                              seed=0, max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              speculative_config=speculative_config), **(engine_args or {})}
        self.model = model
        self.eager = eager
        self.spec = speculative_config
        self.engine_args = dict(engine_args or {})
        self.temperature = temperature
        self.llm = None
        self._ids = 0
        self.tokens: dict[str, list[list[int]]] = {}  # per run ("throughput", "latency", "decode"): outputs in order

    @property
    def label(self) -> str:
        mode = "eager" if self.eager else "compiled"
        if self.spec is not None:
            mode += f", {self.spec.method} k={self.spec.k}"
        mode += "".join(f", {k}={v}" for k, v in self.engine_args.items())
        return f"toolkit ({mode})"

    def spec_counters(self) -> dict | None:
        """The engine's speculative-decoding counters so far (None without speculation)."""
        return dict(self.llm.engine.stats()["spec_decode"]) if self.spec is not None else None

    def kv_counters(self) -> dict:
        """The prefix cache's and tiers' counters so far (cli/bench/metrics.py KV_COUNTERS)."""
        stats = self.llm.engine.stats()
        prefix, tiers = stats["prefix_cache"], stats.get("kv_tiers") or {}
        hits = tiers.get("hit_tokens", {})
        moved = {f"{d}_bytes": n for d, n in tiers.get("bytes_moved", {}).items()}
        return {"queries": prefix["queries"], "hits": prefix["hits"], "device_hits": prefix["device_hits"],
                "cpu_hits": hits.get("cpu", 0), "disk_hits": hits.get("disk", 0), **moved}

    def expert_counters(self) -> dict | None:
        """Tokens routed to each expert of each MoE layer so far (None for a dense model)."""
        from toolkit.models.moe import expert_token_counts

        counts = expert_token_counts(self.llm.engine.runner.model)
        return {"tokens": [c.tolist() for _, c in counts]} if counts else None

    def _fresh(self) -> None:
        # Each timed run starts without what the warm-up or an earlier run left cached (as vLLM's does).
        self.llm.reset_prefix_cache()

    def start(self, warm: BenchRequest) -> dict:
        from toolkit import LLM

        start = time.perf_counter()
        self.llm = LLM(str(self.model), **self.kwargs)
        constructed = time.perf_counter() - start
        if self.spec is not None:
            # Long enough to draft and verify (k + 1 tokens a step after the first): every graph of the
            # speculative path compiles here, not inside the timed run.
            room = self.kwargs["max_model_len"] - warm.prompt_len
            warm = BenchRequest(warm.prompt_token_ids, max(warm.output_len, min(2 * (self.spec.k + 1) + 2, room)))
        self._drain(self._add([warm]), no_progress("", 1))
        total = time.perf_counter() - start
        stats = self.llm.engine.stats()
        return {"total_s": total, "construct_s": constructed, "warmup_s": total - constructed,
                "load_s": stats["load_s"], "compile_s": stats["compile_s"], "engine": stats}

    @property
    def dtype(self) -> torch.dtype:
        return self.llm.engine.dtype

    def _params(self, r: BenchRequest):
        from toolkit import SamplingParams

        return SamplingParams(temperature=self.temperature, max_tokens=r.output_len, ignore_eos=True)

    def _add(self, requests: list[BenchRequest]) -> dict[str, BenchRequest]:
        added = {}
        for r in requests:
            rid = f"bench-{self._ids}"
            self._ids += 1
            self.llm.engine.add_request(rid, r.prompt_token_ids, self._params(r), arrival_time=time.monotonic())
            added[rid] = r
        return added

    def _drain(self, added: dict[str, BenchRequest], advance: Advance, record: str | None = None) -> int:
        engine, tokens, outputs = self.llm.engine, 0, {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens += _check_output(out, added)
                outputs[out.request_id] = out.outputs[0].token_ids
                advance(1)
        if record is not None:
            self.tokens[record] = [outputs[rid] for rid in added]
        return tokens

    def throughput(self, requests: list[BenchRequest], phase: Phase) -> dict:
        advance = phase(f"{self.label}: throughput", len(requests))
        self._fresh()
        compile_before = self.llm.engine.stats()["compile_s"]
        start = time.perf_counter()
        tokens = self._drain(self._add(requests), advance, record="throughput")
        elapsed = time.perf_counter() - start
        out = throughput_metrics(len(requests), sum(r.prompt_len for r in requests), tokens, elapsed)
        # A compile inside the timed run would make it slower than steady state: report it.
        out["compile_in_run_s"] = self.llm.engine.stats()["compile_s"] - compile_before
        return out

    def latency(self, requests: list[BenchRequest], concurrency: int, phase: Phase,
                description: str = "latency") -> tuple[list[RequestTiming], float]:
        """Keep at most `concurrency` requests in flight, adding the next one as soon as one finishes."""
        engine = self.llm.engine
        self._fresh()
        advance = phase(f"{self.label}: {description}", len(requests))
        queue = deque(requests)
        inflight: dict[str, tuple[RequestTiming, BenchRequest]] = {}
        timings: list[RequestTiming] = []
        order, outputs = [], {}

        def admit():
            while queue and len(inflight) < concurrency:
                r = queue.popleft()
                rid = f"bench-{self._ids}"
                self._ids += 1
                now = time.monotonic()
                engine.add_request(rid, r.prompt_token_ids, self._params(r), arrival_time=now)
                inflight[rid] = (RequestTiming(now, r.prompt_len), r)
                order.append(rid)

        start = time.monotonic()
        admit()
        while engine.has_unfinished():
            finished = {out.request_id: out for out in engine.step()}
            now = time.monotonic()
            for rid, (timing, r) in inflight.items():
                if rid in finished:
                    _check_output(finished[rid], {rid: r})
                    outputs[rid] = finished[rid].outputs[0].token_ids
                    count = len(outputs[rid])
                else:
                    try:
                        count = engine.request_output_len(rid)
                    except KeyError:
                        count = timing.output_len
                timing.add(now, count - timing.output_len)
            for rid in finished:
                timings.append(inflight.pop(rid)[0])
                advance(1)
            admit()
        self.tokens["decode" if description == "batch-1 decode" else "latency"] = [outputs[rid] for rid in order]
        return timings, time.monotonic() - start

    def decode(self, request: BenchRequest, phase: Phase) -> RequestTiming:
        timings, _ = self.latency([request], 1, phase, "batch-1 decode")
        return timings[0]

    def profile(self, requests: list[BenchRequest], phase: Phase, row_limit: int = 30) -> dict:
        """The workload again under torch.profiler (not timed: the profiler slows it down)."""
        from torch.profiler import ProfilerActivity, profile

        advance = phase(f"{self.label}: profile", len(requests))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self._drain(self._add(requests), advance)
        averages = prof.key_averages()
        rows = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in averages) or 1
        top = [{"name": e.key, "self_cpu_ms": e.self_cpu_time_total / 1000, "self_cpu_pct": 100 * e.self_cpu_time_total / total,
                "calls": e.count} for e in rows[:row_limit]]
        return {"top": top, "table": averages.table(sort_by="self_cpu_time_total", row_limit=row_limit)}


def _check_output(out, added: dict[str, BenchRequest]) -> int:
    if out.error:
        raise BenchError(f"request {out.request_id} failed: {out.error}")
    got = len(out.outputs[0].token_ids)
    want = added[out.request_id].output_len if out.request_id in added else got
    if got != want:
        raise BenchError(f"request {out.request_id} produced {got} tokens, expected {want}")
    return got


# --- transformers ------------------------------------------------------------------------------


class _StepClock:
    """A transformers streamer that only timestamps each decoding step (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.monotonic())

    def end(self) -> None:
        pass


class HFSystem:
    """transformers `generate`: static batches sorted by length, left padding, greedy (or sampled at the
    bench's temperature), no EOS stop.

    Every request of a batch runs to the batch's longest output (min_new_tokens = max_new_tokens =
    that length); only each request's own output_len tokens are counted as output, the rest is the
    static batch's waste (reported as `generated_tokens`).
    """

    name = "hf"
    label = "transformers"

    def __init__(self, model: Path, *, dtype: torch.dtype, batch_size: int, temperature: float = 0.0):
        self.path = model
        self.dtype = dtype
        self.batch_size = batch_size
        self.temperature = temperature
        self.model = None

    def start(self, warm: BenchRequest) -> dict:
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.logging.set_verbosity_error()
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype).eval()
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        loaded = time.perf_counter() - start
        self._generate([warm], 2)
        total = time.perf_counter() - start
        return {"total_s": total, "load_s": loaded, "warmup_s": total - loaded}

    def _generate(self, batch: list[BenchRequest], new_tokens: int, streamer=None) -> torch.Tensor:
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every prompt ends at the last column
            ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[i, width - r.prompt_len:] = 1
        # Sampled: plain temperature sampling, generation_config's top-k/top-p defaults switched off.
        sampling = dict(do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0) if self.temperature > 0 \
            else dict(do_sample=False)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      pad_token_id=self.pad_id, streamer=streamer, **sampling)
        if out.shape[1] - width != new_tokens:
            raise BenchError(f"transformers generated {out.shape[1] - width} tokens, expected {new_tokens}")
        return out

    def throughput(self, requests: list[BenchRequest], phase: Phase) -> dict:
        advance = phase(f"{self.label}: throughput (batch {self.batch_size})", len(requests))
        generated = 0
        start = time.perf_counter()
        for batch in hf_batches(requests, self.batch_size):
            reqs = [requests[i] for i in batch]
            steps = max(r.output_len for r in reqs)
            self._generate(reqs, steps)
            generated += steps * len(reqs)
            advance(len(reqs))
        elapsed = time.perf_counter() - start
        out = throughput_metrics(len(requests), sum(r.prompt_len for r in requests),
                                 sum(r.output_len for r in requests), elapsed)
        out["generated_tokens"] = generated  # including tokens past each request's own length
        out["batch_size"] = self.batch_size
        return out

    def latency(self, requests: list[BenchRequest], concurrency: int, phase: Phase,
                description: str = "latency") -> tuple[list[RequestTiming], float]:
        """Static batches of `concurrency` requests; a batch's requests all arrive when it starts."""
        advance = phase(f"{self.label}: {description} (batches of {concurrency})", len(requests))
        timings = []
        start = time.monotonic()
        for batch in hf_batches(requests, concurrency):
            reqs = [requests[i] for i in batch]
            clock = _StepClock()
            arrival = time.monotonic()
            self._generate(reqs, max(r.output_len for r in reqs), streamer=clock)
            for r in reqs:
                timing = RequestTiming(arrival, r.prompt_len)
                for t in clock.times[: r.output_len]:
                    timing.add(t, 1)
                timings.append(timing)
            advance(len(reqs))
        return timings, time.monotonic() - start

    def decode(self, request: BenchRequest, phase: Phase) -> RequestTiming:
        timings, _ = self.latency([request], 1, phase, "batch-1 decode")
        return timings[0]


# --- vLLM ----------------------------------------------------------------------------------------

WORKER = Path(__file__).with_name("vllm_worker.py")


def vllm_env() -> dict:
    """vLLM's CPU build's settings: KV cache 4 GiB, no reserved core, OpenMP threads bound to all cores."""
    env = dict(os.environ)
    cores = os.cpu_count() or 1
    for key, value in (("VLLM_TARGET_DEVICE", "cpu"), ("VLLM_CPU_KVCACHE_SPACE", "4"),
                       ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"), ("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")):
        env.setdefault(key, value)
    # Our interpreter's paths must not leak into the other environment.
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return env


class VLLMSystem:
    """vLLM's offline engine in a subprocess of another Python environment (`--peer-python`)."""

    name = "vllm"
    label = "vLLM"

    def __init__(self, model: Path, *, python: Path, dtype: str, eager: bool, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, speculative_config: dict | None = None,
                 enable_prefix_caching: bool = True, temperature: float = 0.0):
        self.python = Path(python)
        # Absolute: the worker runs in a temporary directory.
        self.config = dict(model=str(Path(model).resolve()), dtype=dtype, enforce_eager=eager, max_model_len=max_model_len,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           speculative_config=speculative_config, enable_prefix_caching=enable_prefix_caching,
                           temperature=temperature)

    def run(self, *, mode: str, requests: list[BenchRequest], warm: BenchRequest, concurrency: int,
            decode: BenchRequest | None, phase: Phase, timeout_s: float | None = None,
            probe: Callable[[], dict] | None = None) -> dict:
        """Start-up, the mode's run and the decode run, all in one subprocess (one start-up paid).

        With `probe`, the worker waits before and after its decode run while we call it (a bandwidth
        probe, taken with vLLM idle); the best of the two readings is the result's "decode_bandwidth".
        """
        if not self.python.is_file():
            raise BenchError(f"--peer-python {self.python} does not exist")
        pack = lambda r: {"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}  # noqa: E731
        spec = dict(self.config, mode=mode, concurrency=concurrency, warm=pack(warm),
                    requests=[pack(r) for r in requests], decode=pack(decode) if decode else None,
                    wait_for_probes=probe is not None)
        result, probes = run_worker([str(self.python), str(WORKER)], spec, vllm_env(), phase, self.label,
                                    "toolkit-bench-vllm-", probe, timeout_s)
        if "latency" in result:
            result["latency"]["timings"] = [RequestTiming.from_json(t) for t in result["latency"]["timings"]]
        if result.get("decode"):
            result["decode"] = RequestTiming.from_json(result["decode"])
            if len(probes) == 2:
                result["decode_bandwidth"] = best_of_probes(*probes)
        return result


def run_worker(argv: list[str], spec: dict, env: dict, phase: Phase, label: str, prefix: str,
               probe: Callable[[], dict] | None = None, timeout_s: float | None = None) -> tuple[dict, list]:
    """Run a worker program (`argv` + the path of `spec` as JSON) in a temporary directory and follow the
    JSON events it prints, one per line: "phase"/"advance" drive our progress bar, "probe" asks us
    to take a bandwidth reading while it waits (then it is told to go on), "result" is the outcome.
    Returns (result, the probes' readings); a worker that fails is a BenchError ending with its log."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        spec_path, log_path = Path(tmp) / "spec.json", Path(tmp) / "worker.log"
        spec_path.write_text(json.dumps(spec))
        result, advance, probes = None, no_progress("", 0), []
        with open(log_path, "w") as log:
            proc = subprocess.Popen([*argv, str(spec_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=log, text=True, env=env, cwd=tmp)
            try:
                for line in proc.stdout:
                    try:
                        event = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # something in the worker's environment printed to stdout
                    if not isinstance(event, dict):
                        continue
                    if event.get("event") == "phase":
                        advance = phase(f"{label}: {event['name']}", event["total"])
                    elif event.get("event") == "advance":
                        advance(event.get("n", 1))
                    elif event.get("event") == "probe" and probe is not None:
                        probes.append(probe())
                        proc.stdin.write("\n")  # go on
                        proc.stdin.flush()
                    elif event.get("event") == "result":
                        result = event["result"]
                proc.wait(timeout=timeout_s)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                proc.stdin.close()
        if proc.returncode != 0 or result is None:
            tail = log_path.read_text()[-3000:]
            raise BenchError(f"{label} worker exited with status {proc.returncode}; its log ends:\n{tail}")
    return result, probes


def python_of(path: str | Path) -> Path:
    """A venv folder or a python executable -> the executable."""
    path = Path(path)
    if path.is_dir():
        return path / "bin" / "python"
    return path
