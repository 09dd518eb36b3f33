"""The progress bar on stderr (requests done, output tokens/s, ETA) and the per-line error messages."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# Beyond this many, error messages stop: the error records in the output file hold them all.
MAX_PRINTED_ERRORS = 20


class Reporter:
    def __init__(self, console: Console, total: int, done: int, show_bar: bool):
        columns = (
            TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        )
        self.console = console
        self.progress = Progress(*columns, console=console, disable=not show_bar, transient=False)
        self.task = self.progress.add_task("generate", total=total, completed=done, rate="")
        self.tokens = 0
        self.errors = 0

    def __enter__(self) -> "Reporter":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def advance(self, output_tokens: int) -> None:
        self.tokens += output_tokens
        elapsed = self.progress.tasks[0].elapsed or 1e-9
        self.progress.update(self.task, advance=1, rate=f"{self.tokens / elapsed:,.0f} tok/s")

    def error(self, message: str) -> None:
        self.errors += 1
        if self.errors <= MAX_PRINTED_ERRORS:
            self.console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
        elif self.errors == MAX_PRINTED_ERRORS + 1:
            self.console.print("[red]more errors:[/red] not printed; every one has an error record in the output")
