"""Faults from outside the engine, through the real CLI process: the output's disk fills mid-run."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import pytest

from tests.checkpoints import write_checkpoint, write_tokenizer
from tests.cli.test_cli import ENGINE_FLAGS, REPO, RESUME_FLAGS, by_line, generate, prompts_file

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
