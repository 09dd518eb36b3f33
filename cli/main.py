"""The `toolkit` command line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(help="A small, torch.compile-centric LLM inference toolkit.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
console = Console(stderr=True)

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "toolkit" / "default_model" / "target"


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log engine set-up (KV cache size, compile).")):
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt to complete."),
    model: Optional[Path] = typer.Option(None, help="Hugging Face model folder (default: the built-in model)."),
    max_tokens: int = typer.Option(64, help="New tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed."),
    eager: bool = typer.Option(False, "--eager", help="Skip torch.compile."),
):
    """Complete one prompt and print the text."""
    from toolkit import LLM, SamplingParams

    path = model or DEFAULT_MODEL
    if not path.is_dir():
        console.print(f"[red]error:[/red] model folder not found: {path}")
        raise typer.Exit(2)
    llm = LLM(str(path), enforce_eager=eager)
    out = llm.generate([prompt], SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed),
                       use_tqdm=False)[0]
    print(prompt + out.outputs[0].text)


if __name__ == "__main__":
    app()
