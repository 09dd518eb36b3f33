"""`toolkit generate --tp 2` / `--dp 2` / `--pp 2` / `--prefill-instances 1 --decode-instances 1`, launched for real (the CLI relaunches itself through
torch.distributed.run, gloo on CPU), against the single-process CLI run on the same input.

Oracle: the single-process records, compared by id, line, text and token count (records stream in
completion order, so they are compared per line). --dp also leaves no shard files behind and every
input line exactly once. Kept tiny (4 prompts, 6 tokens): each launch starts 2 processes on a
shared 2-core machine.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.cli.output_file import merge_shards, shard_path
from tests.checkpoints import write_checkpoint, write_tokenizer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--eager", "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", "8MiB",
         "--max-tokens", "6", "--quiet"]
PROMPTS = ["hello world", "a list comprehension is", "", "the quick brown fox", "tensor parallel"]
TIMEOUT_S = 300  # a healthy launch takes ~20-60 s here: reaching this is a hang
LONG_CONTEXT = 131_072
# Each worker's peak resident memory may exceed the single process's by this much (gloo, the process
# groups, DTensor): the KV caches of this run are a few MiB; the old default's were 0.3 of the
# host's available memory shared by the workers (6 GiB on a 21 GiB host), far above it.
WORKER_OVERHEAD = 256 * 2**20


def run_cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "toolkit.cli.main", "generate", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def run_cli_measured(*args) -> tuple[subprocess.CompletedProcess, int, list[int]]:
    """run_cli, and the peak resident memory (VmHWM, bytes) of the process started and of each worker
    it relaunched itself as, read from /proc every 20 ms while each lives: the last reading is its
    peak up to then, and a KV cache is allocated at start and held to the end, so it is in it."""
    import threading

    import psutil  # accelerate depends on it

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    top = subprocess.Popen([sys.executable, "-m", "toolkit.cli.main", "generate", *map(str, args)], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}
    done = threading.Event()

    parents: dict[int, int] = {}

    def sample():
        me = psutil.Process(top.pid)
        while not done.wait(0.02):
            try:
                processes = [me, *me.children(recursive=True)] if top.poll() is None else []
            except psutil.NoSuchProcess:  # one exited while the tree was listed
                continue
            for p in processes:
                peak = vm_hwm(p.pid)
                if peak is not None and "toolkit.cli.main" in " ".join(_cmdline(p)):
                    peaks[p.pid] = max(peaks.get(p.pid, 0), peak)
                    parents.setdefault(p.pid, _ppid(p))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        stdout, stderr = top.communicate(timeout=TIMEOUT_S)
    finally:
        done.set()
        sampler.join()
        top.kill()
    # A worker's own children (the C++ kernels' compiler, forked from it) carry its command line until
    # they exec: they are not workers, and their resident pages are the worker's.
    workers = [peak for pid, peak in peaks.items() if pid != top.pid and parents.get(pid) not in peaks.keys() - {top.pid}]
    return subprocess.CompletedProcess(top.args, top.returncode, stdout, stderr), peaks.get(top.pid, 0), workers


def vm_hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # it exited meanwhile
        pass
    return None


def by_line(path: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    lines = [r["line"] for r in records]
    assert len(lines) == len(set(lines)), f"a line has two records: {sorted(lines)}"
    return {r["line"]: {"id": r["id"], "outputs": [(o["text"], len(o["token_ids"])) for o in r.get("outputs", [])],
                        "error": r.get("error")} for r in records}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_parallel")
    # A long context, so a KV cache sized for max_num_seqs requests of max_model_len tokens (the old
    # default) would be large: 256 x 131,072 tokens x 256-512 bytes, 8-16 GiB per process.
    ckpt = write_tokenizer(write_checkpoint(root / "llama3", "llama3", seed=3, max_position_embeddings=LONG_CONTEXT))
    prompts = root / "prompts.txt"
    prompts.write_text("".join(p + "\n" for p in PROMPTS))
    single = root / "single.jsonl"
    proc, peak, _ = run_cli_measured("-m", ckpt, "-i", prompts, "-o", single, *FLAGS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected = by_line(single)
    assert sorted(expected) == [1, 2, 4, 5]  # the blank line 3 is skipped
    return Case(ckpt, prompts, expected, peak)


class Case(tuple):
    """(ckpt, prompts, expected), as the tests unpack it, and the single process's peak resident memory."""

    def __new__(cls, ckpt, prompts, expected, peak):
        case = super().__new__(cls, (ckpt, prompts, expected))
        case.single_peak = peak
        return case


# The KV cache at its default size (no --kv-cache-memory, max_model_len the model's 131,072).
DEFAULT_KV = [f for f in FLAGS if f not in ("--kv-cache-memory", "8MiB", "--max-model-len", "128")]


@pytest.mark.parametrize("flags", [["--tp", 2], ["--dp", 2], ["--pp", 2], ["--tp", 2, "--dp", 2]],
                         ids=["tp2", "dp2", "pp2", "tp2-dp2"])
def test_parallel_runs_match_single_process_within_a_memory_budget(case, tmp_path, flags):
    """Also the memory oracle (#36): every worker's default KV cache is sized for what this input asks
    (4 requests of a few tokens each), so the workers' summed peak resident memory stays within what
    as many single processes take, plus WORKER_OVERHEAD each. Sized as before, for 256 requests of
    max_model_len tokens, each worker took its share of 0.3 of the available memory (gigabytes)."""
    ckpt, prompts, expected = case
    out = tmp_path / "out.jsonl"
    proc, _, workers = run_cli_measured("-m", ckpt, "-i", prompts, "-o", out, *DEFAULT_KV, *flags)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert by_line(out) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"], "shard files left behind"
    assert proc.stderr.count("done:") == 1, "only rank 0 prints the summary"
    if "--pp" in flags:  # each stage's idle share is reported
        assert "pipeline idle: stage 1 (layers 0-0)" in proc.stderr and "stage 2 (layers 1-1)" in proc.stderr
    nproc = math.prod(size for size in flags if isinstance(size, int))
    assert len(workers) == nproc, workers
    budget = nproc * (case.single_peak + WORKER_OVERHEAD)
    assert sum(workers) <= budget, (f"workers' peak memory {[w >> 20 for w in workers]} MiB sums over the budget "
                                    f"{budget >> 20} MiB (single process {case.single_peak >> 20} MiB)")


DISAGGREGATED = ["--prefill-instances", "1", "--decode-instances", "1"]


@pytest.mark.parametrize("shape", [["--decode-token-cost", "4"], ["--pp", "2", "--prefill-pp", "1"], ["--dp", "2"]],
                         ids=["1p1d-prefill-serves", "1p1d-decode-pp2", "1p1d-decode-dp2"])
def test_prefill_and_decode_instances_match_single_process(case, tmp_path, shape):
    """Text prompts tokenized on every rank, prefilled on one process, decoded on the other (on a
    two-stage pipeline, whose first rank writes the shard; on two replicas, each writing a shard; or,
    with --decode-token-cost, some served whole by the prefill process, which writes a shard too),
    whose shards are merged into OUT; the summary says what KV crossed over."""
    ckpt, prompts, expected = case
    out = tmp_path / "out.jsonl"
    proc = run_cli("-m", ckpt, "-i", prompts, "-o", out, *FLAGS, *DISAGGREGATED, *shape, "--window", "2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert by_line(out) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"], "shard files left behind"
    handed = re.search(r"KV handoff: (\d+) prompts", proc.stderr)
    assert proc.stderr.count("done:") == 1 and handed, proc.stderr[-4000:]
    # Every prompt handed over, or (--decode-token-cost) some of the four served whole on the prefill side.
    assert 0 < int(handed[1]) < 4 if "--decode-token-cost" in shape else int(handed[1]) == 4, proc.stderr[-4000:]


def test_dp_resumes_from_an_interrupted_runs_shard(case, tmp_path):
    """A shard left by a killed --dp run (with a torn last line) is merged first; the rest is redone."""
    ckpt, prompts, expected = case
    out = tmp_path / "out.jsonl"
    # One finished record in replica 1's shard, plus a torn line that must be dropped.
    shard = shard_path(out, 1, 2)
    record = {"id": 1, "line": 1}
    shard.write_text(json.dumps(record) + "\n" + '{"id": 5, "li')
    assert merge_shards(out) == 1 and not shard.exists()
    assert list(by_line(out)) == [1]
    shard.write_text('{"id": 5, "li')  # as if the relaunched run were killed again before writing
    with_bar = [f for f in FLAGS if f != "--quiet"]
    proc = run_cli("-m", ckpt, "-i", prompts, "-o", out, *with_bar, "--dp", "2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The bar (its last state, as printed when stderr is not a terminal) counts the whole job, the
    # line found done included, not rank 0's replica's share (which was "2/2").
    assert re.search(r"generating .* 4/4 ", proc.stderr), proc.stderr[-4000:]
    got = by_line(out)
    assert sorted(got) == sorted(expected)
    assert all(got[line] == expected[line] for line in expected if line != 1)


@pytest.mark.parametrize("flags", [["--dp", "2"], DISAGGREGATED])
def test_dp_or_disaggregation_with_a_single_prompt_is_an_error(flags):
    proc = run_cli("hello", *flags)
    assert proc.returncode == 2
    assert "--input" in proc.stderr and "--output" in proc.stderr


def test_disaggregation_flags_that_do_not_combine_fail_before_any_process_starts(tmp_path):
    proc = run_cli("-i", tmp_path / "x.txt", "-o", tmp_path / "o.jsonl", "--prefill-instances", "1")
    assert proc.returncode == 2 and "--prefill-instances 1 and --decode-instances 0" in proc.stderr
    proc = run_cli("-i", tmp_path / "x.txt", "-o", tmp_path / "o.jsonl", "--prefill-pp", "2")
    assert proc.returncode == 2 and "--prefill-pp needs --prefill-instances and --decode-instances" in proc.stderr
    proc = run_cli("-i", tmp_path / "x.txt", "-o", tmp_path / "o.jsonl", "--decode-token-cost", "2")
    assert proc.returncode == 2 and "--decode-token-cost needs --prefill-instances and --decode-instances" in proc.stderr


@pytest.mark.parametrize("flags", [["--dp", "2"], DISAGGREGATED], ids=["dp", "disaggregated"])
def test_kill_9_of_a_parallel_run_takes_its_workers_and_a_rerun_completes(case, tmp_path, flags):
    """The relaunched workers run in their own sessions: without PR_SET_PDEATHSIG a kill -9 of the
    command would leave them running (PPID 1), still writing shards. A disaggregated run's decode
    instance writes a shard as a replica does, and is resumed the same way."""
    import signal
    import time

    import psutil  # accelerate depends on it
    ckpt, _, _ = case
    prompts = tmp_path / "prompts.txt"
    lines = 96  # with one sequence at a time, seconds of work left when the kill comes (~1 line written)
    prompts.write_text("".join(f"the cat number {i} sat on\n" for i in range(lines)))
    long = ["--max-tokens", "48", "--ignore-eos", "--max-num-seqs", "1"]
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "toolkit.cli.main", "generate", "-m", ckpt, "-i", prompts, "-o", out, *FLAGS, *long,
           *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    top = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        workers = _wait_for_writing_workers(psutil.Process(top.pid), out, deadline=time.monotonic() + TIMEOUT_S)
        top.send_signal(signal.SIGKILL)
    finally:
        top.wait()
    _, alive = psutil.wait_procs(workers, timeout=3)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:  # do not leave them to the rest of the suite
        p.kill()
    assert not alive, f"workers outlived the killed command: {[p.pid for p in alive]}"
    # They died with it, not of old age: work was left (orphans would have run to the end).
    # (Orphans would also have merged the shards into OUT: count both.)
    written = sum(f.read_bytes().count(b"\n") for f in tmp_path.glob(out.name + "*") if f.name != out.name + ".lock")
    assert written < lines, "the workers finished every line: they outlived the kill"

    single = tmp_path / "single.jsonl"
    assert run_cli("-m", ckpt, "-i", prompts, "-o", single, *FLAGS, *long).returncode == 0
    proc = run_cli("-m", ckpt, "-i", prompts, "-o", out, *FLAGS, *long, *flags)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert by_line(out) == by_line(single)  # every line once, the same tokens as one uninterrupted process
    assert not [p for p in tmp_path.iterdir() if ".dp" in p.name], "shard files left behind"


def _wait_for_writing_workers(top, out: Path, deadline: float) -> list:
    """The launched workers, once both exist and some shard holds a record (they are generating)."""
    import time

    while time.monotonic() < deadline:
        workers = [p for p in top.children(recursive=True) if "toolkit.cli.main" in " ".join(_cmdline(p))]
        shards = list(out.parent.glob(out.name + ".dp*"))
        if len(workers) == 2 and any(s.read_bytes().count(b"\n") >= 1 for s in shards):
            return workers
        assert top.status() != "zombie", "the run ended before it was killed"
        time.sleep(0.05)
    raise AssertionError("the two workers never started writing")


def _ppid(process) -> int | None:
    try:
        return process.ppid()
    except Exception:  # it exited meanwhile
        return None


def _cmdline(process) -> list[str]:
    try:
        return process.cmdline()
    except Exception:  # it exited (or is not ours to read) between listing and reading
        return []


def test_sigterm_of_a_dp_run_is_one_line_from_rank_0(case, tmp_path):
    """The agent passes the signal on to the workers; rank 0 counts every replica's records (the
    shards, left for the rerun to merge) and removes the lock; the agent's own log lines are not shown."""
    import signal
    import time

    ckpt, _, _ = case
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"the cat number {i} sat on\n" for i in range(200)))
    long = ["--max-tokens", "48", "--ignore-eos", "--max-num-seqs", "1"]
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "toolkit.cli.main", "generate", "-m", ckpt, "-i", prompts, "-o", out, *FLAGS, *long,
           "--dp", "2"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + TIMEOUT_S
    while not any(p.stat().st_size for p in tmp_path.glob("out.jsonl.dp*")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 143, stderr[-3000:]
    written = sum(p.read_bytes().count(b"\n") for p in tmp_path.glob("out.jsonl*") if not p.name.endswith(".lock"))
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].startswith("note: 2 processes on "), stderr  # OMP_NUM_THREADS, said once
    assert lines[1] == (f"error: interrupted (SIGTERM): {written} of 200 lines have records in {out}; "
                        "rerun the same command to resume"), stderr
    assert not Path(f"{out}.lock").exists()
