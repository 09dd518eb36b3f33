"""The `toolkit` command line: `generate` (offline batch generation), `serve` (an OpenAI-compatible server),
`info` (model sizing), `bench` (benchmarks)."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

import toolkit  # noqa: F401  first: its process defaults must be set before torch loads (toolkit/envs.py)
from toolkit.cli.bench import bench_app
from toolkit.cli.generate import generate
from toolkit.cli.help import GroupedHelpCommand
from toolkit.cli.info import info
from toolkit.cli.options import VerboseOpt
from toolkit.cli.serve import serve

app = typer.Typer(
    help="A small, torch.compile-centric LLM inference toolkit. Run `toolkit COMMAND --help` for a command's flags.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # a real bug should print a plain traceback, not a wall of locals
    rich_markup_mode=None,  # plain --help (cli/help.py) and plain one-line usage errors
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("toolkit")
        except PackageNotFoundError:  # run from a checkout that was never installed
            number = "unknown (not installed)"
        typer.echo(f"toolkit {number}")
        raise typer.Exit()


@app.callback()
def main(verbose: VerboseOpt = False,
         version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the toolkit's version and exit.")] = False):
    # --verbose may also come after the command; its callback (options.py) then raises the level.
    logging.basicConfig(format="%(message)s")
    logging.getLogger().setLevel(logging.INFO if verbose else logging.WARNING)  # also on a second run in-process


app.command(cls=GroupedHelpCommand)(generate)
app.command(cls=GroupedHelpCommand)(serve)
app.command(cls=GroupedHelpCommand)(info)
app.add_typer(bench_app, name="bench")


def run() -> None:
    """The `toolkit` command: the app, then an exit that skips the interpreter's teardown.

    Tearing down torch's modules and their C++ state at exit takes a good part of a short answer's
    whole run (docs/benchmarks.md). What exiting must do still happens first: the atexit handlers
    (logging's flush among them) and the flush of stdout and stderr. Where another thread still works
    (a server's, a kernel build after an early error), the exit is the ordinary one, which waits for it.
    """
    import atexit
    import os
    import sys
    import threading

    try:
        app()
        code = 0
    except SystemExit as e:
        code = e.code
    if not isinstance(code, int):  # None: success; a message: printed, status 1 (as sys.exit does)
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`): what Python's own exit would ignore too
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
