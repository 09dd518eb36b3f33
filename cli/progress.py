"""The progress bar on stderr (requests done, output tokens/s, ETA) and the per-line error messages."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# Beyond this many, error messages stop: the error records in the output file hold them all.
MAX_PRINTED_ERRORS = 20


class ShardCounter:
    """The records and output tokens in the data-parallel shard files so far, read incrementally: each
    poll reads only what was appended since the last (records are whole lines, flushed one by one)."""

    def __init__(self, paths: list[Path]):
        self.offsets = {path: 0 for path in paths}
        self.records = 0
        self.tokens = 0

    def poll(self) -> tuple[int, int]:
        for path, offset in self.offsets.items():
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:  # not created yet, or merged away at the end
                continue
            whole = data[: data.rfind(b"\n") + 1]  # a line being written is counted at the next poll
            self.offsets[path] = offset + len(whole)
            for line in whole.splitlines():
                self.records += 1
                try:
                    self.tokens += json.loads(line).get("usage", {}).get("completion_tokens", 0)
                except (ValueError, AttributeError):
                    pass
        return self.records, self.tokens


class Reporter:
    """The bar counts lines with a record: `done` at the start, then one per finished line; with
    `follow` (--dp, on rank 0) the lines every replica wrote to its shard, polled, so it counts the
    whole job rather than rank 0's own replica."""

    POLL_S = 0.25

    def __init__(self, console: Console, total: int, done: int, show_bar: bool,
                 follow: ShardCounter | None = None):
        columns = (
            TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        )
        self.console = console
        self.progress = Progress(*columns, console=console, disable=not show_bar, transient=False)
        self.task = self.progress.add_task("generate", total=total, completed=done, rate="")
        self.tokens = 0
        self.errors = 0
        self.done = done
        self.follow = follow if show_bar else None
        self.stopped = threading.Event()
        self.poller = threading.Thread(target=self._poll_loop, daemon=True, name="toolkit-progress")

    def __enter__(self) -> "Reporter":
        self.progress.start()
        if self.follow is not None:
            self.poller.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.follow is not None:
            self.stopped.set()
            self.poller.join()
            self._poll()  # the shards are complete now: the final count is the job's
        self.progress.stop()

    def _poll_loop(self) -> None:
        while not self.stopped.wait(self.POLL_S):
            self._poll()

    def _poll(self) -> None:
        records, tokens = self.follow.poll()
        elapsed = self.progress.tasks[0].elapsed or 1e-9
        self.progress.update(self.task, completed=self.done + records, rate=f"{tokens / elapsed:,.0f} tok/s")

    def advance(self, output_tokens: int) -> None:
        if self.follow is not None:
            return  # counted from the shards
        self.tokens += output_tokens
        elapsed = self.progress.tasks[0].elapsed or 1e-9
        self.progress.update(self.task, advance=1, rate=f"{self.tokens / elapsed:,.0f} tok/s")

    def error(self, message: str) -> None:
        self.errors += 1
        if self.errors <= MAX_PRINTED_ERRORS:
            self.console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
        elif self.errors == MAX_PRINTED_ERRORS + 1:
            self.console.print("[red]more errors:[/red] not printed; every one has an error record in the output")
