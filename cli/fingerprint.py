"""Fingerprints that let a resumed run check that it continues the same job.

Resuming skips the input lines that already have a record. That is only right when those records
came from the same input line, the same model and the same sampling options: otherwise the output
would silently mix two jobs (with line-number ids, a different input file even looks the same).
So every record carries three short hashes, appended after its own keys:

- `input_sha`: the raw bytes of its input line;
- `model_sha`: the model (its folder, config.json and weight file sizes) and --dtype;
- `settings_sha`: the sampling options (--temperature, --seed, --max-tokens, ...).

Options that do not change the generated tokens are left out, so changing them still resumes:
batching and memory (--window, --max-num-seqs, --kv-*), --quiet, --tp/--dp, --enable-expert-parallel
(where each expert is computed, not what), and --speculative-config (lossless: it changes how fast
tokens come, not which).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from toolkit.weights import checkpoint_files


def short_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def input_sha(raw: bytes) -> str:
    return short_hash(raw)


@dataclass(frozen=True)
class RunFingerprint:
    model_sha: str
    settings_sha: str

    def fields(self) -> dict:
        return {"model_sha": self.model_sha, "settings_sha": self.settings_sha}


def run_fingerprint(model_path: Path, dtype: str, sampling: dict) -> RunFingerprint:
    return RunFingerprint(short_hash(_canonical(model_identity(model_path, dtype))), short_hash(_canonical(sampling)))


def model_identity(path: Path, dtype: str) -> dict:
    """What names a checkpoint without reading its weights (hashing 100 GB would take minutes):
    where it is, its config, and the names and sizes of its weight files."""
    path = Path(path).resolve()
    weights = sorted((f.name, f.stat().st_size) for f in map(Path, checkpoint_files(path)))
    config = (path / "config.json").read_text() if path.is_dir() else ""  # a GGUF file: its size and name say it
    return {"path": str(path), "config": config, "weights": weights, "dtype": dtype}


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, default=str).encode()


class Stamped:
    """Wraps NativeRecords or OpenAIRecords: their records, plus the fingerprints. The keys go last
    because resuming recognizes a record line by how it starts."""

    def __init__(self, records, run: RunFingerprint):
        self.records = records
        self.run = run

    def success(self, job, out) -> dict:
        return self._stamp(job, self.records.success(job, out))

    def failure(self, job, message: str) -> dict:
        return self._stamp(job, self.records.failure(job, message))

    def _stamp(self, job, record: dict) -> dict:
        record["input_sha"] = job.input_sha
        record.update(self.run.fields())
        return record
