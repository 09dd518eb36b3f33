"""The compiled step: one graph with no breaks, a bounded number of graphs, the eager tokens, and as many
engines in one process as a user builds."""

from __future__ import annotations

import os

import pytest
import torch

from tests.checkpoints import random_prompts, write_checkpoint
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
    # Every batch size is dynamic (unbacked: no 0/1 specialization) and the attention kernels serve
    # every step kind, so one graph of the whole model serves this run's hundreds of step shapes.
    assert num_compiled_graphs() == 1


def test_many_engines_in_turn_in_one_process(ckpt, tmp_path):
    """A notebook or a sweep builds engine after engine: each compiled step has a Dynamo cache of its
    own, so no engine counts against another's recompile limit (Dynamo allows 8 per code object), and
    each still gives the tokens of an eager engine of the same model."""
    other = write_checkpoint(tmp_path / "llama3", "llama3", seed=2)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, seed=9)]
    params = SamplingParams(temperature=0, max_tokens=6)
    want = {}
    for path in (ckpt, other):
        eager = LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=96)
        want[path] = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    codes = set()
    for i in range(10):
        path = (ckpt, other)[i % 2]
        llm = LLM(str(path), dtype="float32", compile_backend="eager", max_model_len=96 + 16 * (i % 3))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want[path], i
        # The step's code is this engine's alone and holds its one graph: nothing accumulates.
        code = llm.engine.runner.step.forward._torchdynamo_orig_callable.__code__
        assert code not in codes and len(_debug_get_cache_entry_list(code)) == 1
        codes.add(code)
        del llm


def test_inductor_cache_goes_under_the_toolkit_cache_unless_the_user_chose_one(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from toolkit.transforms import _use_persistent_inductor_cache

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
