"""Decoder-layer graphs saved by one start and loaded by the next (toolkit/precompiled.py).

The oracle is transformers' greedy tokens, for graphs compiled in this process, loaded in a fresh
one, recompiled from a damaged file, and left to the JIT path when precompiling fails.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention import AttentionMetadata
from tests.checkpoints import hf_greedy, random_prompts, write_checkpoint
from toolkit import LLM, SamplingParams, decode_step_cpu, precompiled

REPO = Path(__file__).resolve().parent.parent
PROMPTS = random_prompts(5, seed=11, low=3, high=30)
NEW_TOKENS = 10


@pytest.fixture(autouse=True)
def layer_graphs_for_decode_steps_too(monkeypatch):
    # Else decode steps take the C++ decode step (tests/test_decode_step_cpu.py) and make no graph;
    # the fresh process below inherits this.
    monkeypatch.setenv(decode_step_cpu.SWITCH, "0")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=5)  # q/k norms: more in the graph


@pytest.fixture(scope="module")
def expected(ckpt):
    return hf_greedy(ckpt, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("toolkit-cache")


def _generate(ckpt):
    llm = LLM(str(ckpt), dtype="float32", max_model_len=96, kv_cache_memory_bytes=1 << 22)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def _saved(cache: Path) -> list[Path]:
    return sorted((cache / "precompiled").glob("*.aot"))


def test_graphs_compiled_here_and_loaded_by_a_fresh_process_give_transformers_tokens(ckpt, expected, cache,
                                                                                       monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE", str(cache))
    monkeypatch.delenv(precompiled.SWITCH, raising=False)
    llm, tokens = _generate(ckpt)
    assert tokens == expected
    assert llm.engine.runner.precompiled.sources == {"mixed": "compiled", "decode": "compiled"}
    assert [p.name.split("-")[1] for p in _saved(cache)] == ["decode", "mixed"]
    assert llm.engine.runner.compile_seconds > 0

    child = (
        "import json, sys; sys.path.insert(0, sys.argv[2]); from tests.test_precompiled import _generate; "
        "llm, tokens = _generate(sys.argv[1]); "
        "print(json.dumps({'tokens': tokens, 'sources': llm.engine.runner.precompiled.sources}))"
    )
    env = {**os.environ, "TOOLKIT_CACHE": str(cache)}
    run = subprocess.run([sys.executable, "-c", child, str(ckpt), str(REPO)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["sources"] == {"mixed": "loaded", "decode": "loaded"}
    assert report["tokens"] == expected


def test_a_graph_file_that_does_not_load_is_compiled_again(ckpt, expected, cache, monkeypatch, caplog):
    monkeypatch.setenv("TOOLKIT_CACHE", str(cache))
    monkeypatch.delenv(precompiled.SWITCH, raising=False)
    if not _saved(cache):
        _generate(ckpt)
    damaged = _saved(cache)[0]
    damaged.write_bytes(b"not a saved graph")
    with caplog.at_level(logging.WARNING, logger="toolkit"):
        llm, tokens = _generate(ckpt)
    assert tokens == expected
    assert "could not load the precompiled graph" in caplog.text
    assert sorted(llm.engine.runner.precompiled.sources.values()) == ["compiled", "loaded"]
    assert damaged.read_bytes() != b"not a saved graph"  # replaced by the recompiled graph


def test_when_precompiling_fails_layers_take_the_jit_path(ckpt, expected, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))

    def fail(self, example):
        raise RuntimeError("aot_compile is unavailable")

    monkeypatch.setattr(precompiled.PrecompiledLayers, "_compile", fail)
    with caplog.at_level(logging.WARNING, logger="toolkit"):
        llm, tokens = _generate(ckpt)
    assert tokens == expected
    assert llm.engine.runner.precompiled.sources == {"mixed": "jit", "decode": "jit"}
    assert "aot_compile is unavailable" in caplog.text
    assert _saved(tmp_path) == []


def test_the_key_changes_with_what_the_graph_depends_on_and_not_with_the_weights(ckpt):
    llm = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=96, kv_cache_memory_bytes=1 << 22)
    layers = llm.engine.runner.model.model.layers
    kv = llm.engine.runner.kv_caches[0]
    empty = torch.zeros(0, dtype=torch.int32)
    meta = AttentionMetadata(empty, empty, empty.view(0, 0), empty.long(), backend="torch")
    key = precompiled.graph_key(layers[0], "mixed", kv, meta, None)
    assert precompiled.graph_key(layers[1], "mixed", kv, meta, None) == key  # other weights, same graph
    others = [
        precompiled.graph_key(layers[0], "decode", kv, meta, None),
        precompiled.graph_key(layers[0], "mixed", kv[:, :-1], meta, None),  # another KV cache size
        precompiled.graph_key(layers[0], "mixed", kv.to(torch.bfloat16), meta, None),
        precompiled.graph_key(layers[0], "mixed", kv, AttentionMetadata(empty, empty, empty.view(0, 0), empty.long(),
                                                                         backend="triton"), None),
        precompiled.graph_key(layers[0], "mixed", kv, meta, {"assert_indirect_indexing": False}),
    ]
    layers[0].self_attn.scale *= 2  # a constant the graph bakes in
    others.append(precompiled.graph_key(layers[0], "mixed", kv, meta, None))
    assert len({key, *others}) == len(others) + 1


@pytest.mark.parametrize("device, backend, tp, switch, on", [
    ("cpu", "inductor", None, None, True),
    ("cpu", "inductor", None, "0", False),
    ("cpu", "eager", None, None, False),
    ("cpu", "inductor", object(), None, False),
    ("cuda", "inductor", None, None, False),
])
def test_where_graphs_are_precompiled(device, backend, tp, switch, on, monkeypatch):
    if switch is None:
        monkeypatch.delenv(precompiled.SWITCH, raising=False)
    else:
        monkeypatch.setenv(precompiled.SWITCH, switch)
    assert precompiled.enabled(torch.device(device), backend, tp) is on
