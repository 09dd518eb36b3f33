"""The output JSONL file: resuming from what an earlier (perhaps killed) run wrote, and appending to it.

Each record is one `write` of one line followed by a flush, so after `kill -9` the file holds whole
records plus at most one torn last line. Resuming cuts that torn line off and reports the input
lines that already have a record; the run then does only the others. Together that gives every
input line exactly one record, however many times the run is interrupted.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path
from typing import IO

from toolkit.cli.errors import CliError
from toolkit.cli.interrupts import held
from toolkit.cli.records import record_id


class OutputLock:
    """An exclusive lock on OUTPUT.lock while a run writes OUTPUT, so two runs never write one output
    (each would append every line). The lock file goes when the run ends; a killed run's lock dies
    with it (the file stays, unlocked, and the next run takes it).

    Used as `with OutputLock(path) as lock: lock.take(); ...`: the lock is taken inside the block,
    with SIGINT and SIGTERM held back until it is (cli/interrupts.py's `held`), so a signal is raised
    where `__exit__` removes the lock file, never between the file's creation and the block."""

    def __init__(self, path: Path | None):
        self.output = path
        self.path = Path(f"{path}.lock") if path is not None else None
        self.handle = None

    def __enter__(self):
        return self

    def take(self) -> None:
        if self.output is None:
            return
        with held():  # a signal meanwhile is raised once self.handle is set, inside the caller's `with`
            self.handle = lock_output(self.output)

    def __exit__(self, *exc):
        if self.handle is not None:
            self.path.unlink(missing_ok=True)  # while still held: a waiting run finds it gone or locked
            self.handle.close()
        return False


def lock_output(path: Path):
    """Take OUTPUT.lock (see OutputLock); returns the open lock file."""
    import fcntl

    lock_path = Path(f"{path}.lock")
    try:
        handle = open(lock_path, "a+")
    except OSError as e:
        raise CliError(f"cannot write next to --output {path}: {e.strerror} ({lock_path})") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise CliError(f"--output {path} is being written by {holder} (it holds {lock_path}); wait for it to "
                       "finish, or pick another --output") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"toolkit generate, pid {os.getpid()} on {os.uname().nodename}\n")
    handle.flush()
    return handle


class Resume:
    """What an existing output file already answers."""

    def __init__(self, done: dict[int, object], errors: int, torn_bytes: int,
                 input_shas: dict[int, str] | None = None, runs: dict[tuple, int] | None = None):
        self.done = done  # {input line number: the id its record carries}
        self.errors = errors  # how many of those records are errors
        self.torn_bytes = torn_bytes  # size of the torn last line that was cut off (0: none)
        self.input_shas = input_shas or {}  # {input line number: its record's input_sha}
        self.runs = runs or {}  # {(model_sha, settings_sha): the first line whose record has them}


def resume_from(path: Path) -> Resume:
    if not path.exists():
        return Resume({}, 0, 0)
    if not path.is_file():
        raise CliError(f"--output {path} is not a file")
    resume = Resume({}, 0, 0)
    good_end = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.endswith(b"\n") and _could_be_ours(raw):
                break  # a kill mid-write: our records always end with a newline
            if raw.strip():
                record = _parse_record(raw)
                if record is None:
                    raise CliError(f"{path} line {number} is not a toolkit output record; "
                                   "pass another --output, or remove the file to start over")
                _remember(resume, record)
            good_end += len(raw)
    resume.torn_bytes = path.stat().st_size - good_end
    if resume.torn_bytes:
        os.truncate(path, good_end)
    return resume


def _remember(resume: Resume, record: dict) -> None:
    line = record["line"]
    resume.done[line] = record_id(record)
    resume.errors += record.get("error") is not None
    # Records written before fingerprints existed have none: they are taken on trust (see resume_check).
    if record.get("input_sha") is not None:
        resume.input_shas[line] = record["input_sha"]
    run = (record.get("model_sha"), record.get("settings_sha"))
    if run != (None, None):
        resume.runs.setdefault(run, line)


# Both record formats are dicts whose first key is "id", so every record line starts like this.
_RECORD_START = b'{"id": '


def _could_be_ours(raw: bytes) -> bool:
    head = raw[: len(_RECORD_START)]
    return _RECORD_START[: len(head)] == head


def _parse_record(raw: bytes) -> dict | None:
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("line"), int):
        return None
    return record


class RecordWriter:
    """Appends one JSON line per record and flushes it, so a kill loses at most the line being written."""

    def __init__(self, path: Path | None):
        self.path = path
        self._file: IO[str] | None = None

    def __enter__(self) -> "RecordWriter":
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # backslashreplace: a lone surrogate in generated text becomes a valid JSON "\udcxx" escape
            # instead of an encoding error that would end the run.
            self._file = open(self.path, "a", encoding="utf-8", errors="backslashreplace")
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass  # the write that failed said so; its torn line is cut and redone on resume

    def write(self, record: dict) -> None:
        out = self._file if self._file is not None else sys.stdout
        try:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
        except OSError as e:  # disk full, quota, file size limit: finished records stay, resume redoes the rest
            where = self.path or "stdout"
            raise CliError(f"writing {where} failed: {e.strerror or e}; every record before this one is kept: "
                           "make room and rerun the same command to resume") from None


# --- data parallel shards ----------------------------------------------------------------------
# With --dp N, replica i writes its records to OUTPUT.dp{i}-of-{N} (flushed per record, like OUTPUT).
# Once every replica is done, global rank 0 appends the shards' records that OUTPUT lacks and deletes
# the shards; a run that starts with shards left by an interrupted one merges them first. Either way
# every input line ends up in OUTPUT exactly once.


def shard_path(output: Path, index: int, count: int) -> Path:
    return output.with_name(f"{output.name}.dp{index}-of-{count}")


def existing_shards(output: Path) -> list[Path]:
    return sorted(Path(p) for p in glob.glob(glob.escape(str(output)) + ".dp*-of-*"))


def merge_shards(output: Path) -> int:
    """Append every shard's records for lines OUTPUT has no record of yet, then delete the shards;
    returns how many records were appended. A torn last line in a shard (a killed run) is dropped."""
    shards = existing_shards(output)
    if not shards:
        return 0
    done = resume_from(output).done  # also cuts a torn last line of OUTPUT (a merge that was killed)
    added = 0
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "ab") as out:
        for shard in shards:
            with open(shard, "rb") as f:
                for number, raw in enumerate(f, 1):
                    if not raw.endswith(b"\n"):
                        break  # torn by a kill mid-write: that line is redone by the next run
                    if not raw.strip():
                        continue
                    record = _parse_record(raw)
                    if record is None:
                        raise CliError(f"{shard} line {number} is not a toolkit output record; remove it to go on")
                    if record["line"] in done:
                        continue
                    out.write(raw)
                    done[record["line"]] = record_id(record)
                    added += 1
            out.flush()
        os.fsync(out.fileno())
    for shard in shards:
        shard.unlink()
    return added
