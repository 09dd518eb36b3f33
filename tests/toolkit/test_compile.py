"""The compiled step: one graph with no breaks, a bounded number of graphs, and the eager tokens."""

from __future__ import annotations

import os

import pytest
import torch

from tests.checkpoints import hf_greedy, random_prompts, write_checkpoint
from toolkit import LLM, SamplingParams
from toolkit.runner import num_compiled_graphs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=1)


def test_varied_batches_stay_within_the_graph_bound(ckpt):
    """Dynamo with the eager backend: the same graphs Inductor would get, without Inductor's cost."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    llm = LLM(str(ckpt), dtype="float32", compile_backend="eager", max_model_len=256, max_num_batched_tokens=64,
              max_num_seqs=16)
    prompts = random_prompts(40, seed=7, low=1, high=150)
    params = [SamplingParams(temperature=0, max_tokens=1 + i % 23, ignore_eos=True) for i in range(40)]
    eager = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=256, max_num_batched_tokens=64,
                max_num_seqs=16)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    got = llm.generate(inputs, params, use_tqdm=False)
    want = eager.generate(inputs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert dict(counters["graph_break"]) == {}, "the step must trace as one graph"
    # Dynamic shapes, token counts padded to >= 2 (dynamo specializes sizes 0/1) and one compiled
    # decoder layer shared by all layers: a few graphs (mixed steps, decode-only steps) serve every
    # batch; far fewer than the distinct step shapes of this run.
    assert 1 <= num_compiled_graphs() <= 4


def test_inductor_compiled_matches_transformers_and_eager(ckpt):
    prompts = random_prompts(8, seed=2, low=3, high=40)
    expected = hf_greedy(ckpt, prompts, 16)
    llm = LLM(str(ckpt), dtype="float32", max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.runner.compile_seconds > 0


def test_inductor_cache_goes_under_the_toolkit_cache_unless_the_user_chose_one(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from toolkit.runner import _use_persistent_inductor_cache

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    for before in (None, default_cache_dir()):  # unset, or filled in by torch._dynamo's import
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        _use_persistent_inductor_cache()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    _use_persistent_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
