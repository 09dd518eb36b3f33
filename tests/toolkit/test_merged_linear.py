"""Merged q/k/v and gate/up projections (toolkit/merged_linear.py): the same outputs as the separate
linears, every weight held once, and the engine serving merged models token for token as transformers."""

import pytest
import torch
from torch import nn

from tests.checkpoints import hf_greedy, random_prompts, write_checkpoint
from toolkit import LLM, SamplingParams
from toolkit.backends.cpu import kernels
from toolkit.backends.cpu.linear import NEVER, LinearPlan, pack_linears
from toolkit.merged_linear import MergedLinear, merge_linears, project


class Block(nn.Module):
    merge_groups = (("a", "b", "c"),)

    def __init__(self, biases=(True, False, True)):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(24, n, bias=bias) for n, bias in zip((32, 16, 48), biases))

    def forward(self, x):
        return project(x, self.a, self.b, self.c)


@pytest.mark.parametrize("biases", [(True, False, True), (False, False, False), (True, True, True)])
def test_merged_outputs_match_the_separate_linears(biases):
    torch.manual_seed(0)
    block = Block(biases)
    x = torch.randn(5, 24)
    want = block(x)
    params = sum(p.numel() for p in block.parameters())
    assert merge_linears(block) == 1
    assert isinstance(block.a, MergedLinear) and block.b is None and block.c is None
    assert block.a.splits == (32, 16, 48)
    # A missing bias is merged as zeros, so the count grows only by those zeros.
    missing = sum(n for n, bias in zip((32, 16, 48), biases) if not bias) if any(biases) else 0
    assert sum(p.numel() for p in block.parameters()) == params + missing
    got = block(x)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    assert merge_linears(block) == 0  # merging twice changes nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_panels_are_bitwise_the_separate_panels(dtype):
    # The panel kernel computes each 16-column panel alike, so merging must not move a single bit.
    assert kernels.load() == {}, "the CPU kernels did not build (a C++ compiler is part of the test setup)"
    torch.manual_seed(0)
    separate, merged = Block(), Block()
    merged.load_state_dict(separate.state_dict())
    for module in (separate, merged):
        module.to(dtype)
    merge_linears(merged)
    panels = LinearPlan(panels=True, onednn=False, small_m=NEVER, source="test")
    pack_linears(separate, panels)
    pack_linears(merged, panels)
    assert merged.a.splits == (32, 16, 48)
    for rows in (1, 2, 7):
        x = torch.randn(rows, 24).to(dtype)
        for g, w in zip(merged(x), separate(x)):
            assert torch.equal(g, w)


def test_merge_needs_one_input_size():
    with pytest.raises(ValueError, match="same input size"):
        MergedLinear([nn.Linear(8, 4), nn.Linear(9, 4)])


def test_engine_merges_and_matches_transformers(tmp_path):
    # qwen2 has q/k/v biases; its merged bias must land on the right columns.
    path = write_checkpoint(tmp_path, "qwen2", seed=5)
    prompts = random_prompts(3, seed=5)
    llm = LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=96, seed=0, skip_tokenizer_init=True)
    runner = llm.engine.runner
    layers = llm.engine.model_config.num_layers
    assert f"{2 * layers} linear groups merged" in llm.engine.stats()["model_changes"]
    attn = runner.model.model.layers["0"].self_attn
    assert attn.k_proj is None and attn.v_proj is None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, max_new_tokens=12)
