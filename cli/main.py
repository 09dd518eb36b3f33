"""The `toolkit` command line: `generate` (offline batch generation), `info` (model sizing), `bench` (benchmarks)."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

import toolkit  # noqa: F401  first: its process defaults must be set before torch loads (toolkit/envs.py)
from toolkit.cli.bench import bench_app
from toolkit.cli.generate import generate
from toolkit.cli.info import info

app = typer.Typer(
    help="A small, torch.compile-centric LLM inference toolkit. Run `toolkit COMMAND --help` for a command's flags.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # a real bug should print a plain traceback, not a wall of locals
    rich_markup_mode="rich",
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
def main(verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Log engine set-up (KV cache size, compile) to stderr.")] = False,
         version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the toolkit's version and exit.")] = False):
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")


app.command()(generate)
app.command()(info)
app.add_typer(bench_app, name="bench")


if __name__ == "__main__":
    app()
