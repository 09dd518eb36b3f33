"""One-line errors with an exit code, instead of tracebacks, for problems the user can fix."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

# Exit codes: 0 all lines succeeded, 1 some input line failed, 2 the job could not start
# (bad flag, missing model or input, unusable output file). 2 is also click's usage-error code.
EXIT_LINE_FAILED = 1
EXIT_SETUP = 2
EXIT_INTERRUPTED = 130  # SIGINT, as a shell reports it


class CliError(Exception):
    """A problem the user fixes by changing a flag or a file; printed as one line."""

    def __init__(self, message: str, code: int = EXIT_SETUP):
        super().__init__(message)
        self.code = code


def stderr_console() -> Console:
    # Made per call, not at import: the console binds sys.stderr when it prints, which keeps
    # the output capturable by click's test runner and by anything that redirects stderr.
    return Console(stderr=True, highlight=False)


def exit_with(error: CliError) -> None:
    stderr_console().print(f"[red]error:[/red] {escape(str(error))}", soft_wrap=True)
    raise typer.Exit(error.code)
