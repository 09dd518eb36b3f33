"""The engine against transformers on the same weights: greedy tokens exact, prefill logits close.

For every family the toolkit serves, in every way a step can run: eager and compiled (the whole
model, one Inductor graph; on CPU with its C++ wrapper), each with the device's kernels (on CPU the C++
linear and attention ops) and without them (torch's own ops: nn.Linear and the reference attention).
Each on a batch of prompts of different lengths, in the normal configuration, and the kernels' modes
also with chunked prefill forced (a token budget smaller than the prompts) and with preemption forced
(a KV cache too small for the batch). float32 throughout; half types are held to transformers' own
error in the same dtype by tests/toolkit/test_bf16_error.py (every path, prefill and decode).
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import FAMILIES, hf_greedy, random_prompts, write_checkpoint
from tests.toolkit.bf16_error import engine_logits
from toolkit import LLM, SamplingParams

NUM_PROMPTS = 8
NEW_TOKENS = 32
BYTES_PER_TOKEN = {"mistral": 1024, "tied_mqa": 256, "qwen3": 1024}  # 2 * layers * kv_heads * head_dim * 4

BACKENDS = {
    "eager-kernels": dict(enforce_eager=True),
    "eager-torch": dict(enforce_eager=True, cpu_kernels=False),
    "compiled-kernels": dict(),
    "compiled-torch": dict(cpu_kernels=False),
}
MODES = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 12},
    "preemption": {"kv_blocks": 8},
}
# Every backend in the default mode; chunked prefill and preemption with the kernels, eager and compiled.
CASES = [(b, "default") for b in BACKENDS] + [(b, m) for b in ("eager-kernels", "compiled-kernels")
                                              for m in ("chunked_prefill", "preemption")]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request, tmp_path_factory):
    family = request.param
    path = write_checkpoint(tmp_path_factory.mktemp(family), family, seed=1)
    prompts = random_prompts(NUM_PROMPTS, seed=2, low=3, high=40)
    return family, path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


def make_llm(family: str, path, backend: str = "eager-kernels", *, kv_blocks: int | None = None,
             dtype: str = "float32", **kwargs) -> LLM:
    if kv_blocks is not None:
        kwargs["kv_cache_memory_bytes"] = kv_blocks * 16 * BYTES_PER_TOKEN.get(family, 512)
    return LLM(str(path), dtype=dtype, max_model_len=128, block_size=16, **BACKENDS[backend], **kwargs)


@pytest.mark.parametrize("backend,mode", CASES)
def test_greedy_tokens_match_transformers(family_case, backend, mode):
    family, path, prompts, expected = family_case
    llm = make_llm(family, path, backend, **MODES[mode])
    stats = llm.engine.stats()
    kernels = backend.endswith("kernels")
    assert (stats["attention_backend"] == "cpu") == kernels
    assert (stats["backend"]["packed_linears"] > 0) == kernels
    seen = count_preemptions(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{family}/{backend}/{mode}: prompt {i} (len {len(prompts[i])}) diverges at {first_diff(g, e)}"
    if backend.startswith("compiled"):
        # One graph serves prefill, mixed and decode steps; the torch backend's decode-only steps trace
        # their attention into a second one.
        assert 1 <= llm.engine.stats()["graphs"] <= (1 if kernels else 2)
    if mode == "preemption":
        assert llm.engine.runner.kv_spec.num_blocks == 8
        assert seen["count"] > 0, "the KV budget was meant to force preemption"
    if mode == "chunked_prefill":
        assert max(seen["tokens"]) <= 12


@pytest.mark.parametrize("backend", ["eager-kernels", "eager-torch"])
def test_prefill_logits_match_transformers(family_case, backend):
    family, path, prompts, _ = family_case
    check_prefill_logits(family, path, prompts[:3], backend)


def check_prefill_logits(family: str, path, prompts: list[list[int]], backend: str) -> None:
    """Every position's logits of each prompt, prefilled in one step, within 1e-4 of transformers'."""
    from transformers import AutoModelForCausalLM

    runner = make_llm(family, path, backend).engine.runner
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt in prompts:
        ours = prefill_logits(runner, prompt)
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def prefill_logits(runner, prompt: list[int]) -> torch.Tensor:
    """The logits of every position of a prompt prefilled in one step."""
    return engine_logits(runner, [prompt])[0]


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
