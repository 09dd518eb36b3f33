"""Faults from outside the engine, through the real CLI process: the output's disk fills mid-run; SIGINT
and SIGTERM while starting and while generating, also in a job started with SIGINT ignored."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.checkpoints import write_checkpoint, write_tokenizer
from tests.cli.test_cli import ENGINE_FLAGS, REPO, RESUME_FLAGS, by_line, generate, prompts_file, toolkit
from toolkit.cli import output_file

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tokenizer(write_checkpoint(tmp_path_factory.mktemp("llama"), "llama3", seed=3))


def test_a_full_disk_mid_run_is_one_line_and_the_rerun_resumes(ckpt, tmp_path):
    prompts = prompts_file(tmp_path, 12)
    reference = tmp_path / "reference.jsonl"
    assert generate(ckpt, "-i", prompts, "-o", reference, *RESUME_FLAGS).exit_code == 0
    room = sum(len(line) for line in reference.read_bytes().splitlines(keepends=True)[:4]) + 10

    def small_disk():
        # A file-size limit fails writes past `room` bytes with an OSError, as a full disk does.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (room, room))

    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "toolkit.cli.main", "generate", "-i", prompts, "-o", out, "-m", ckpt,
           *ENGINE_FLAGS, *RESUME_FLAGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOOLKIT_CPU_KERNELS": "0"}  # no kernel build to write
    run = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300, preexec_fn=small_disk)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert f"writing {out} failed" in run.stderr and "rerun the same command to resume" in run.stderr
    kept = out.read_bytes()
    assert kept.count(b"\n") >= 3  # what was written before the disk filled is still there

    rerun = generate(ckpt, "-i", prompts, "-o", out, *RESUME_FLAGS)
    assert rerun.exit_code == 0, rerun.output
    assert by_line(out) == by_line(reference)


# --- signals -------------------------------------------------------------------------------------

# Enough lines that the tiny model is still generating (~1 s) when the signal comes after the second record.
LINES = 300


def start_generate(ckpt, prompts, out, preexec_fn=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "toolkit.cli.main", "generate", "-i", prompts, "-o", out, "-m", ckpt,
           *ENGINE_FLAGS, *RESUME_FLAGS]
    return subprocess.Popen([str(c) for c in cmd], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)


def wait_until(proc: subprocess.Popen, ready) -> None:
    deadline = time.monotonic() + 120
    while not ready():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.005)


def records_in(out: Path) -> int:
    return out.read_bytes().count(b"\n") if out.exists() else 0


def assert_one_line(stderr: str, line: str) -> None:
    assert [l for l in stderr.splitlines() if l.strip()] == [f"error: {line}"], stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_generating_says_what_was_written_and_removes_the_lock(ckpt, tmp_path, signum):
    prompts, out = prompts_file(tmp_path, LINES), tmp_path / "out.jsonl"
    proc = start_generate(ckpt, prompts, out)
    wait_until(proc, lambda: records_in(out) >= 2)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    name = "interrupted" if signum == signal.SIGINT else "interrupted (SIGTERM)"
    assert proc.returncode == 128 + signum, stderr
    assert_one_line(stderr, f"{name}: {records_in(out)} of {LINES} lines have records in {out}; "
                            "rerun the same command to resume")
    assert not Path(f"{out}.lock").exists()


def test_sigint_while_starting_says_so_and_removes_the_lock(ckpt, tmp_path):
    prompts, out = prompts_file(tmp_path, 12), tmp_path / "out.jsonl"
    proc = start_generate(ckpt, prompts, out)
    wait_until(proc, Path(f"{out}.lock").exists)  # taken before the model loads
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert_one_line(stderr, f"interrupted: {records_in(out)} of 12 lines have records in {out}; "
                            "rerun the same command to resume")
    assert not Path(f"{out}.lock").exists()


def test_sigint_between_taking_the_lock_and_counting_the_input_says_how_far_the_output_got(ckpt, tmp_path, monkeypatch):
    # In-process: the signal is real, sent while the run reads the model's fingerprint, after the output's
    # lock is taken and before the input is counted (the window the subprocess test above can land in).
    prompts, out = prompts_file(tmp_path, 12), tmp_path / "out.jsonl"
    out.write_text('{"a": 1}\n{"b": 2}\n')  # two records a killed run left (fingerprinted or not: never read)

    def fingerprint(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
        raise AssertionError("the signal did not interrupt the start")

    monkeypatch.setattr("toolkit.cli.generate.fingerprint", fingerprint)
    result = toolkit("generate", "-m", ckpt, *ENGINE_FLAGS, "-i", prompts, "-o", out)
    assert result.exit_code == 130, result.output
    assert result.stderr.strip() == (f"error: interrupted: 2 of 12 lines have records in {out}; rerun the same "
                                     "command to resume")
    assert not Path(f"{out}.lock").exists()


def test_sigint_while_the_lock_is_being_taken_lands_once_it_is_held_and_the_lock_goes(ckpt, tmp_path, monkeypatch):
    # In-process: the signal is real, sent after the lock file exists and before the lock is held by the
    # run (the window the subprocess test above can land in on a loaded machine).
    prompts, out = prompts_file(tmp_path, 12), tmp_path / "out.jsonl"
    take = output_file.lock_output

    def lock_output(path):
        handle = take(path)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # where an undeferred signal would land: the lock file made, not yet the run's
        return handle

    monkeypatch.setattr(output_file, "lock_output", lock_output)
    result = toolkit("generate", "-m", ckpt, *ENGINE_FLAGS, "-i", prompts, "-o", out)
    assert result.exit_code == 130, result.output
    assert result.stderr.strip() == (f"error: interrupted: 0 of 12 lines have records in {out}; rerun the same "
                                     "command to resume")
    assert not Path(f"{out}.lock").exists()


def test_a_job_started_with_sigint_ignored_can_still_be_interrupted(ckpt, tmp_path):
    # As a script's `cmd &`, or a scheduler, starts it: SIGINT ignored from the start.
    prompts, out = prompts_file(tmp_path, LINES), tmp_path / "out.jsonl"
    proc = start_generate(ckpt, prompts, out, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    wait_until(proc, lambda: records_in(out) >= 2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert_one_line(stderr, f"interrupted: {records_in(out)} of {LINES} lines have records in {out}; "
                            "rerun the same command to resume")
    assert not Path(f"{out}.lock").exists()


def test_sigint_while_a_prompt_loads_its_model_is_one_line(ckpt, monkeypatch):
    # In-process: the signal is real, sent to this process while the command loads the model.
    def load_engine(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
        raise AssertionError("the signal did not interrupt the load")

    monkeypatch.setattr("toolkit.cli.generate.load_engine", load_engine)
    result = toolkit("generate", "-m", ckpt, *ENGINE_FLAGS, "hello")
    assert result.exit_code == 130
    assert result.stderr.strip() == "error: interrupted before the completion was printed"
