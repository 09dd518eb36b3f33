"""`toolkit serve`'s command line, without starting a server: help, and the mistakes caught before loading."""

from __future__ import annotations

import re
import socket

import pytest
import typer
from typer.testing import CliRunner

from toolkit.cli.main import app


def toolkit(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env, catch_exceptions=False)


@pytest.mark.parametrize("name", ["serve", "bench serve"])
def test_help_is_plain_and_whole_at_80_columns(name):
    result = toolkit(*name.split(), "--help", env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert max(map(len, text.splitlines())) <= 80, text
    assert not set("╭╰│─…") & set(text), text
    command = typer.main.get_command(app)
    for part in name.split():
        command = command.commands[part]
    for param in command.params:
        for opt in param.opts + param.secondary_opts if param.param_type_name == "option" else ():
            assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text), f"{opt} is not in full in:\n{text}"


def test_serve_takes_the_engine_flags_of_generate():
    command = typer.main.get_command(app)
    serve, generate = command.commands["serve"], command.commands["generate"]
    ours = {opt for p in serve.params for opt in p.opts}
    engine_panels = ("Model", "Engine", "KV cache hierarchy", "Parallel")
    theirs = {opt for p in generate.params if getattr(p, "rich_help_panel", None) in engine_panels for opt in p.opts}
    assert theirs <= ours, theirs - ours
    assert {"--tp", "--pp", "--dp", "--pp-layer-partition", "--enable-expert-parallel", "--prefill-instances",
            "--decode-instances", "--prefill-tp", "--quantization"} <= ours


def test_a_port_in_use_is_a_one_line_error_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        # The model folder does not exist: had the command got as far as loading, it would say so instead.
        result = toolkit("serve", tmp_path / "no-model", "--port", port)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: cannot listen on 127.0.0.1:") and len(result.stderr.splitlines()) == 1


def test_two_different_models_are_an_error(tmp_path):
    result = toolkit("serve", tmp_path / "a", "--model", tmp_path / "b")
    assert result.exit_code == 2 and "two models given" in result.stderr
