"""Logprob objects and prompt logprobs, against transformers' log_softmax on the same weights (float32):
one step or many prefill chunks, with the prefix cache on, and in the compiled step."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import random_prompts, write_checkpoint, write_tokenizer
from toolkit import LLM, Logprob, SamplingParams
from toolkit.runner import num_compiled_graphs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 3
# Prompts of 20-50 tokens run as several chunks under an 8-token budget; one and two tokens are the edges.
PROMPTS = random_prompts(4, seed=7, low=20, high=50) + [[5], [5, 6]]
CONFIGS = {
    "one_step": {},
    "chunked_prefill": {"max_num_batched_tokens": 8},
    "prefix_caching": {"enable_prefix_caching": True},
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tokenizer(write_checkpoint(tmp_path_factory.mktemp("llama"), "llama3", seed=3))


@pytest.fixture(scope="module")
def reference(ckpt):
    """log_softmax of transformers' logits at every position of a sequence."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return log_softmax


def make_llm(ckpt, **kwargs) -> LLM:
    kwargs.setdefault("enforce_eager", True)
    return LLM(str(ckpt), dtype="float32", max_model_len=96, block_size=16, seed=0, **kwargs)


def check_entry(entry: dict[int, Logprob], row: torch.Tensor, token: int, k: int, tokenizer) -> None:
    """`entry` is `token`'s and the top k of `row` (a reference log_softmax), with vLLM's ranks and text."""
    assert token in entry
    assert set(entry) - {token} <= set(row.topk(k + 1).indices.tolist()) and len(entry) >= k
    for t, lp in entry.items():
        assert isinstance(lp, Logprob)
        assert lp.logprob == pytest.approx(row[t].item(), abs=1e-4)
        # 1-based rank in the whole vocabulary; float noise may only swap near-ties.
        assert 1 + (row > row[t] + 1e-4).sum().item() <= lp.rank <= 1 + (row > row[t] - 1e-4).sum().item()
        assert lp.decoded_token == (None if tokenizer is None else tokenizer.decode([t]))


def check_prompt_logprobs(out, reference, k: int = K, tokenizer=None) -> None:
    prompt = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    rows = reference(prompt)
    for p in range(1, len(prompt)):
        check_entry(out.prompt_logprobs[p], rows[p - 1], prompt[p], k, tokenizer)


@pytest.mark.parametrize("config", CONFIGS)
def test_prompt_logprobs_match_transformers(ckpt, reference, config):
    llm = make_llm(ckpt, **CONFIGS[config])
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = SamplingParams(temperature=0, max_tokens=4)
    want = llm.generate(inputs, plain, use_tqdm=False)  # with prefix caching: every prompt's blocks cached
    # Requests with and without prompt logprobs in one batch: the sampled rows are the same either way.
    params = [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=K) if i % 3 != 1 else plain
              for i in range(len(PROMPTS))]
    got = llm.generate(inputs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for out, p in zip(got, params):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        check_prompt_logprobs(out, reference, tokenizer=llm.get_tokenizer())
        if config == "prefix_caching":
            assert out.num_cached_tokens == 0  # cached blocks have no logits: vLLM reads none for these
    if config == "prefix_caching":
        # The others still hit the cache, and so does a later run once the prompt logprobs are done.
        assert any(o.num_cached_tokens for o, p in zip(got, params) if p.prompt_logprobs is None)
        assert all(o.num_cached_tokens for o in llm.generate(inputs[:4], plain, use_tqdm=False))


def test_prompt_logprobs_with_n_and_zero_top_k(ckpt, reference):
    # One sequence of the n computes them; k = 0 gives the prompt token's entry alone.
    llm = make_llm(ckpt, max_num_batched_tokens=8)
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=3, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    check_prompt_logprobs(out, reference, k=0, tokenizer=llm.get_tokenizer())
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])


def test_prompt_logprobs_survive_preemption(ckpt, reference):
    # A KV cache too small for the batch: requests are preempted and recompute their prompts.
    llm = make_llm(ckpt, kv_cache_memory_bytes=6 * 16 * 512, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params, use_tqdm=False)
    for out in outs:
        check_prompt_logprobs(out, reference, k=2, tokenizer=llm.get_tokenizer())


def test_sample_logprobs_have_ranks_and_text(ckpt, reference):
    llm = make_llm(ckpt)
    prompt = PROMPTS[1]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=1.0, seed=5, max_tokens=8,
                                                                      logprobs=2), use_tqdm=False)[0].outputs[0]
    rows = reference(prompt + out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        check_entry(entry, rows[len(prompt) - 1 + i], token, 2, llm.get_tokenizer())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_without_a_tokenizer_decoded_token_is_none(ckpt, reference):
    llm = make_llm(ckpt, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=1, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0]
    check_prompt_logprobs(out, reference, k=1)
    assert all(lp.decoded_token is None for e in out.outputs[0].logprobs for lp in e.values())


def test_compiled_step_serves_prompt_logprobs_in_its_one_graph(ckpt, reference):
    """Dynamo with the eager backend (the graphs Inductor would get): the extra logits rows are one more
    dynamic size, not a second graph."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    llm = make_llm(ckpt, enforce_eager=False, compile_backend="eager", max_num_batched_tokens=16)
    params = [SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=K if i % 2 else None)
              for i in range(len(PROMPTS))]
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    got = llm.generate(inputs, params, use_tqdm=False)
    want = make_llm(ckpt).generate(inputs, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for out, p in zip(got, params):
        if p.prompt_logprobs is not None:
            check_prompt_logprobs(out, reference, tokenizer=llm.get_tokenizer())
    assert dict(counters["graph_break"]) == {}
    assert num_compiled_graphs() == 1


def test_prompt_logprobs_beside_speculative_verify_rows(ckpt, reference):
    # Prompt rows follow a verify step's 1 + k rows per request: the rejection sampler sees only its own.
    llm = make_llm(ckpt, max_num_batched_tokens=16,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    prompts = [[7, 8, 9] * 8] + PROMPTS[:3]  # a repetitive prompt: n-gram drafts while the others prefill
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=K if i else None)
              for i in range(len(prompts))]
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want = make_llm(ckpt).generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.stats()["spec_decode"]["num_drafts"] > 0
    for out in got[1:]:
        check_prompt_logprobs(out, reference, tokenizer=llm.get_tokenizer())
