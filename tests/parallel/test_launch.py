"""parallel/launch.py's relaunch, through a real torch.distributed.run launch of a tiny script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import os, sys
from toolkit.parallel.launch import maybe_relaunch

code = maybe_relaunch(2)
if code is not None:
    sys.exit(code)
# One write per line: with PYTHONUNBUFFERED (set on these machines) print writes each piece apart, and the
# two ranks' pieces interleaved on the shared pipe once.
os.write(1, f"rank {os.environ['RANK']} threads {os.environ['OMP_NUM_THREADS']}\\n".encode())
"""

pytestmark = pytest.mark.slow


def relaunch(tmp_path, **env) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, str(script)], cwd=REPO, env={**clean, "PYTHONPATH": str(REPO), **env},
                          capture_output=True, text=True, timeout=300)


def test_relaunch_shares_the_cores_out_and_says_so_once_instead_of_torchruns_banner(tmp_path):
    proc = relaunch(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert sorted(proc.stdout.split("\n")[:2]) == [f"rank 0 threads {threads}", f"rank 1 threads {threads}"]
    assert "Setting OMP_NUM_THREADS" not in proc.stderr and "*****" not in proc.stderr, proc.stderr
    assert proc.stderr.count(f"note: 2 processes on {len(os.sched_getaffinity(0))} cores") == 1, proc.stderr


def test_a_users_omp_num_threads_is_kept_and_nothing_is_said(tmp_path):
    proc = relaunch(tmp_path, OMP_NUM_THREADS="3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(proc.stdout.split("\n")[:2]) == ["rank 0 threads 3", "rank 1 threads 3"]
    assert "OMP_NUM_THREADS" not in proc.stderr, proc.stderr
