"""The compiled step kept on disk (toolkit/compiled_cache.py): a fresh process loads it instead of
tracing and gives transformers' tokens; another checkpoint of the same shapes shares the file with its
own weights; another max_model_len is another file; a damaged file is compiled again and replaced; where compiling ahead of time or saving
fails, the step still serves, with a warning; and where Dynamo's guards cannot be stood in for, the
cache is not used."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import hf_greedy, random_prompts, write_checkpoint
from toolkit import LLM, SamplingParams, compiled_cache

WORKER = Path(__file__).with_name("compiled_cache_worker.py")
MAX_TOKENS = 8
SMALL = dict(num_hidden_layers=1)  # one layer: every test here pays an Inductor compile


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two checkpoints of one architecture and shapes, different weights, and transformers' tokens."""
    root = tmp_path_factory.mktemp("compiled_cache")
    prompts = random_prompts(3, seed=11, low=2, high=30)
    paths = [write_checkpoint(root / f"llama{seed}", "llama3", seed=seed, **SMALL) for seed in (1, 2)]
    return paths, prompts, [hf_greedy(p, prompts, MAX_TOKENS) for p in paths]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "compiled"
    monkeypatch.setattr(compiled_cache, "cache_dir", lambda: folder)
    return folder


def generate(path: Path, prompts, **config):
    # The suite runs with TOOLKIT_COMPILE_CACHE=0 (tests/conftest.py): these engines ask for it.
    llm = LLM(str(path), dtype="float32", **{"max_model_len": 96, "compile_cache": True, **config})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine.runner.step.forward


def test_a_fresh_process_loads_the_step_and_another_checkpoint_shares_it(models, cache):
    (first, second), prompts, want = models
    tokens, step = generate(first, prompts)
    assert tokens == want[0]
    assert list(step.sources.values()) == ["compiled"]
    saved = sorted(cache.iterdir())
    assert [p.name for p in saved] == list(step.sources)
    # The file holds the graph, not the weights: the second checkpoint runs its own through it.
    spec = {"models": [str(first), str(second)], "prompts": prompts, "max_tokens": MAX_TOKENS}
    done = subprocess.run([sys.executable, str(WORKER), str(cache), json.dumps(spec)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert [m["tokens"] for m in result["models"]] == want
    assert [m["sources"] for m in result["models"]] == [{saved[0].name: "loaded"}] * 2
    assert result["dynamo_graphs"] == 0, "a loaded step must not be traced again"
    # It finds the library the first process built (the same build key), and does not preprocess
    # Inductor's header to precompile it for a build it does not do.
    assert result["cpp_builds"] == [], result["cpp_builds"]
    assert sorted(cache.iterdir()) == saved


def test_a_moe_step_on_the_cpu_kernels_is_saved_and_loaded(tmp_path, cache):
    """The experts' kernel is called from the step through each layer's dispatcher (a module of the
    CPU backend): nothing it adds may hold a guard the saved step cannot keep (a property's getter
    did: "CLOSURE_MATCH guard cannot be serialized", and the step fell back to the JIT path)."""
    path = write_checkpoint(tmp_path / "moe", "qwen3_moe", seed=3, **SMALL)
    prompts = random_prompts(3, seed=12, low=2, high=30)
    want = hf_greedy(path, prompts, MAX_TOKENS)
    tokens, step = generate(path, prompts)
    assert tokens == want and list(step.sources.values()) == ["compiled"]
    tokens, step = generate(path, prompts)
    assert tokens == want and list(step.sources.values()) == ["loaded"]


def test_another_max_model_len_is_another_step(models, cache):
    """The RoPE table's length is max_model_len's and the saved graph asserts it: a step saved at 96
    found by an engine at 160 failed its first call ("expected size 160==96")."""
    (first, _), prompts, want = models
    _, step = generate(first, prompts)
    tokens, longer = generate(first, prompts, max_model_len=160)
    assert tokens == want[0]
    assert list(longer.sources.values()) == ["compiled"] and set(longer.sources).isdisjoint(step.sources)
    assert len(list(cache.iterdir())) == 2


def test_a_damaged_file_is_compiled_again_and_replaced(models, cache, caplog):
    (first, _), prompts, want = models
    _, step = generate(first, prompts)
    path = cache / next(iter(step.sources))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, logger="toolkit"):
        tokens, step = generate(first, prompts)
    assert tokens == want[0]
    assert list(step.sources.values()) == ["compiled"]
    assert any("could not load the compiled step" in r.getMessage() for r in caplog.records)
    tokens, step = generate(first, prompts)  # the replaced file loads
    assert tokens == want[0] and list(step.sources.values()) == ["loaded"]


def test_where_saving_fails_the_step_still_serves(models, cache, caplog):
    (first, _), prompts, want = models
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="toolkit"):
        tokens, step = generate(first, prompts)
    assert tokens == want[0] and list(step.sources.values()) == ["compiled"]
    assert any("could not save the compiled step" in r.getMessage() for r in caplog.records)


def test_where_compiling_ahead_of_time_fails_the_jit_step_serves(models, cache, caplog, monkeypatch):
    (first, _), prompts, want = models

    def fails(fn, options, args):
        raise RuntimeError("not supported here")

    monkeypatch.setattr(compiled_cache, "aot_compile", fails)
    with caplog.at_level(logging.WARNING, logger="toolkit"):
        tokens, step = generate(first, prompts)
    assert tokens == want[0] and list(step.sources.values()) == ["jit"]
    assert any("not supported here" in r.getMessage() for r in caplog.records)
    assert not cache.exists()


@pytest.mark.parametrize("config", [dict(compile_cache=False), dict(attention_backend="torch"),
                                    dict(compile_backend="eager"), dict(enforce_eager=True)])
def test_not_used_where_its_signature_cannot_stand_in_for_the_guards(models, cache, config):
    """The torch attention backend keeps its token count backed (and reads decode_only); eager and the
    debugging backend compile nothing to keep; compile_cache=False turns it off."""
    (first, _), prompts, want = models
    tokens, step = generate(first, prompts, **config)
    assert tokens == want[0]
    assert not isinstance(step, compiled_cache.CachedStep)
    assert not cache.exists()
