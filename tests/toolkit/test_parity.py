"""The engine against transformers on the same weights (float32): greedy tokens exact, prefill logits close.

For every family the toolkit serves, on a batch of prompts of different lengths, with the engine
in its normal configuration, with chunked prefill forced (a token budget smaller than the
prompts), and with preemption forced (a KV cache too small for the batch).
"""

from __future__ import annotations

import pytest
import torch

from scheduling import ScheduledRequest
from tests.checkpoints import FAMILIES, hf_greedy, random_prompts, write_checkpoint
from toolkit import LLM, SamplingParams

NUM_PROMPTS = 8
NEW_TOKENS = 32
BYTES_PER_TOKEN = {"mistral": 1024, "tied_mqa": 256, "qwen3": 1024}  # 2 * layers * kv_heads * head_dim * 4

MODES = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 12},
    "preemption": {"kv_blocks": 8},
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request, tmp_path_factory):
    family = request.param
    path = write_checkpoint(tmp_path_factory.mktemp(family), family, seed=1)
    prompts = random_prompts(NUM_PROMPTS, seed=2, low=3, high=40)
    return family, path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


def make_llm(family: str, path, *, kv_blocks: int | None = None, dtype: str = "float32", **kwargs) -> LLM:
    if kv_blocks is not None:
        kwargs["kv_cache_memory_bytes"] = kv_blocks * 16 * BYTES_PER_TOKEN.get(family, 512)
    return LLM(str(path), dtype=dtype, enforce_eager=True, max_model_len=128, block_size=16, **kwargs)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_tokens_match_transformers(family_case, mode):
    family, path, prompts, expected = family_case
    llm = make_llm(family, path, **MODES[mode])
    preempted = count_preemptions(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{family}/{mode}: prompt {i} (len {len(prompts[i])}) diverges at {first_diff(g, e)}"
    if mode == "preemption":
        assert llm.engine.runner.kv_spec.num_blocks == 8
        assert preempted["count"] > 0, "the KV budget was meant to force preemption"
    if mode == "chunked_prefill":
        assert max(preempted["tokens"]) <= 12


def test_prefill_logits_match_transformers(family_case):
    from transformers import AutoModelForCausalLM

    family, path, prompts, _ = family_case
    llm = make_llm(family, path)
    runner = llm.engine.runner
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt in prompts[:3]:
        blocks = list(range((len(prompt) + 15) // 16))
        inputs = runner.prepare([ScheduledRequest("r", prompt, 0, blocks, True)])
        inputs.logits_indices = torch.arange(len(prompt))
        ours = runner.execute(inputs)
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_prefill_logits_are_as_close_as_transformers_in_the_same_dtype(family_case, dtype):
    """In bf16 and fp16 there is no exact answer; the oracle is the float32 model. Our engine (on CPU
    the panel linear kernel, half weights widened to float32) must land as near it as transformers in
    the same dtype."""
    from transformers import AutoModelForCausalLM

    family, path, prompts, _ = family_case
    runner = make_llm(family, path, dtype=dtype).engine.runner
    assert runner.packed_linears > 0  # the kernel, not torch's emulated half matmuls
    exact = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    for prompt in prompts[:3]:
        blocks = list(range((len(prompt) + 15) // 16))
        inputs = runner.prepare([ScheduledRequest("r", prompt, 0, blocks, True)])
        inputs.logits_indices = torch.arange(len(prompt))
        ours = runner.execute(inputs).float()
        with torch.no_grad():
            truth = exact(torch.tensor([prompt])).logits[0]
            theirs = hf16(torch.tensor([prompt])).logits[0].float()
        ours_err, theirs_err = (ours - truth).abs().max().item(), (theirs - truth).abs().max().item()
        assert ours_err <= 2 * theirs_err + 1e-3, f"{family}: {dtype} error {ours_err:.4f}, transformers' {theirs_err:.4f}"


def count_preemptions(llm: LLM) -> dict:
    """Wraps the scheduler so a test can see that preemption and chunking really happened."""
    seen = {"count": 0, "tokens": [0]}
    schedule = llm.engine.scheduler.schedule

    def counting():
        out = schedule()
        seen["count"] += len(out.preempted)
        seen["tokens"].append(out.num_batched_tokens)
        return out

    llm.engine.scheduler.schedule = counting
    return seen


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
