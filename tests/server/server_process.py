"""Start `toolkit serve` as a subprocess on a free loopback port, wait until it answers, stop it with SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300  # a healthy start takes ~10 s here (a torchrun launch ~30-60 s): reaching this is a hang


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # stderr to a file, not a pipe nobody reads while the server runs (a full pipe would block it).
        self.stderr = tempfile.TemporaryFile("w+")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "toolkit.cli.main", "serve", *map(str, args), "--port", str(self.port)],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=self.stderr, text=True)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.read_stderr()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError("the server did not answer /health in time")

    def stop(self, timeout: float = 60) -> tuple[int, str]:
        """SIGTERM; (exit code, stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = -9
        return code, self.read_stderr()

    def read_stderr(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """/metrics parsed by prometheus_client's own parser: {(sample name, sorted labels): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}
