"""Speculative decoding in the engine: greedy tokens exactly those of plain decoding (which equal
transformers') for every family, both methods, k in {1, 3, 5}; with chunked prefill and preemption
forced; eager and compiled; stop conditions inside an accepted run; seeded sampling reproducible;
the metrics; and the end-to-end sampled distribution against transformers' exact one."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.checkpoints import FAMILIES, hf_greedy, random_prompts, write_checkpoint, write_tokenizer
from tests.speculative.checkpoints import repetitive_prompts, write_perturbed_draft
from tests.speculative.goodness_of_fit import ALPHA, chi_square_p_value
from tests.toolkit.test_parity import count_preemptions, first_diff, make_llm
from toolkit import LLM, SamplingParams

NEW_TOKENS = 24
METHODS = ("ngram", "draft_model")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    path = write_checkpoint(root / "target", family, seed=1)
    draft = write_perturbed_draft(path, root / "draft")
    prompts = repetitive_prompts(random_prompts(6, seed=2, low=3, high=30))
    return family, path, draft, prompts, hf_greedy(path, prompts, NEW_TOKENS)


def spec(method: str, k: int, draft=None, **extra) -> dict:
    config = {"method": method, "num_speculative_tokens": k, **extra}
    if method == "draft_model":
        config["model"] = str(draft)
    return config


def greedy(llm: LLM, prompts, max_tokens=NEW_TOKENS, **kwargs):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_same(got, expected, what: str):
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{what}: prompt {i} diverges at {first_diff(g, e)}"


CASES = ([(m, k, "eager-kernels", "default") for m, k in itertools.product(METHODS, (1, 3, 5))]
         + [(m, 3, "eager-kernels", mode) for m in METHODS for mode in ("chunked_prefill", "preemption")])


@pytest.mark.parametrize("method,k,backend,mode", CASES)
def test_greedy_with_speculation_is_plain_greedy(family_case, method, k, backend, mode):
    family, path, draft, prompts, expected = family_case
    modes = {"default": {}, "chunked_prefill": {"max_num_batched_tokens": 12}, "preemption": {"kv_blocks": 8}}
    llm = make_llm(family, path, backend, speculative_config=spec(method, k, draft), **modes[mode])
    seen = count_preemptions(llm)
    assert_same(greedy(llm, prompts), expected, f"{family}/{method}/k={k}/{mode}")
    stats = llm.engine.stats()["spec_decode"]
    # The verify path really ran: drafts were proposed, some kept and (for a draft that is not the
    # target) some rejected.
    assert stats["num_drafts"] > 0 and 0 < stats["num_accepted_tokens"]
    if method == "draft_model":
        assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert max(stats["accepted_per_pos"]) <= stats["num_drafts"] and len(stats["accepted_per_pos"]) == k
    if mode == "preemption":
        assert seen["count"] > 0
    if mode == "chunked_prefill":
        assert max(seen["tokens"]) <= 12


@pytest.mark.parametrize("family,method,backend", [
    (family, method, "compiled-kernels") for family in ("llama3", "qwen3") for method in METHODS
] + [("llama3", "draft_model", "compiled-torch")])
def test_compiled_verify_steps_ride_the_one_graph(family, method, backend, tmp_path):
    path = write_checkpoint(tmp_path / "target", family, seed=1)
    draft = write_perturbed_draft(path, tmp_path / "draft")
    prompts = repetitive_prompts(random_prompts(6, seed=2, low=3, high=30))
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    extra = {"kv_blocks": 8} if family == "llama3" else {}  # preemption forced, compiled
    llm = make_llm(family, path, backend, speculative_config=spec(method, 3, draft), **extra)
    assert_same(greedy(llm, prompts), expected, f"{backend} {family}/{method}")
    stats = llm.engine.stats()
    # Prefill, decode and verify steps share one compiled graph (the torch attention backend traces
    # decode-only steps into a second one).
    graphs = 1 if backend == "compiled-kernels" else 2
    assert stats["graphs"] == graphs
    if method == "draft_model":
        # The draft's step (its first draft after each verify) and its greedy loop (drafts 2..k).
        assert stats["draft_runner"]["graphs"] == graphs and stats["draft_runner"]["greedy_loop_graphs"] == 1
    assert stats["spec_decode"]["num_accepted_tokens"] > 0


@pytest.mark.parametrize("k", [1, 3])
def test_the_target_as_its_own_draft_accepts_every_draft(tmp_path, k):
    path = write_checkpoint(tmp_path / "target", "llama3", seed=1)
    prompts = random_prompts(4, seed=3, low=3, high=30)
    llm = make_llm("llama3", path, speculative_config=spec("draft_model", k, path))
    # 1 token from the prefill, then verify steps of k + 1 tokens each, none cut by max_tokens.
    max_tokens = 1 + 4 * (k + 1)
    assert_same(greedy(llm, prompts, max_tokens, ignore_eos=True), hf_greedy(path, prompts, max_tokens), "self-draft")
    stats = llm.engine.stats()["spec_decode"]
    assert stats["acceptance_rate"] == 1.0 and stats["mean_acceptance_length"] == k + 1
    assert stats["accepted_per_pos"] == [stats["num_drafts"]] * k == [4 * len(prompts)] * k
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["toolkit:spec_decode_num_drafts"].value == 4 * len(prompts)
    assert metrics["toolkit:spec_decode_num_draft_tokens"].value == 4 * len(prompts) * k
    assert metrics["toolkit:spec_decode_num_accepted_tokens"].value == 4 * len(prompts) * k
    assert metrics["toolkit:spec_decode_num_accepted_tokens_per_pos"].values == [4 * len(prompts)] * k


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    path = write_checkpoint(root / "target", "llama3", seed=1)
    write_tokenizer(path)
    return path


def test_stops_inside_an_accepted_run_end_where_plain_decoding_ends(text_model):
    """The target as its own draft accepts everything, so every stop lands inside a verified run."""
    prompts = random_prompts(5, seed=4, low=3, high=20)
    plain = LLM(str(text_model), dtype="float32", max_model_len=64, enforce_eager=True)
    ref = plain.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=40,
                                                                                     ignore_eos=True), use_tqdm=False)
    # Stop tokens and stop strings taken from what plain decoding generates, well inside the runs.
    stop_ids = sorted({o.outputs[0].token_ids[7] for o in ref})
    stop_strings = sorted({o.outputs[0].text[10:13] for o in ref if len(o.outputs[0].text) > 14})
    cases = [dict(max_tokens=11, ignore_eos=True), dict(max_tokens=40, stop_token_ids=stop_ids, ignore_eos=True),
             dict(max_tokens=40, stop=stop_strings, ignore_eos=True), dict(max_tokens=40, stop=stop_strings,
                                                                           include_stop_str_in_output=True),
             dict(max_tokens=None, ignore_eos=True), dict(max_tokens=30, min_tokens=9, stop_token_ids=stop_ids),
             dict(max_tokens=12, logprobs=2),
             # Penalties count the drafts before a position as output, as plain decoding counts them.
             dict(max_tokens=30, repetition_penalty=1.5, ignore_eos=True),
             dict(max_tokens=30, frequency_penalty=1.0, presence_penalty=0.5, ignore_eos=True)]
    spec_llm = LLM(str(text_model), dtype="float32", max_model_len=64, enforce_eager=True,
                   speculative_config=spec("draft_model", 5, text_model))
    for kwargs in cases:
        params = SamplingParams(temperature=0, **kwargs)
        a = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        b = spec_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for x, y in zip(a, b):
            x, y = x.outputs[0], y.outputs[0]
            assert (y.token_ids, y.text, y.finish_reason, y.stop_reason) == (
                x.token_ids, x.text, x.finish_reason, x.stop_reason), kwargs
            if kwargs.get("logprobs"):
                assert len(y.logprobs) == len(x.logprobs) == len(x.token_ids)
                for lx, ly in zip(x.logprobs, y.logprobs):
                    assert lx.keys() == ly.keys()
                    assert all(abs(lx[t].logprob - ly[t].logprob) < 1e-4 and lx[t].rank == ly[t].rank for t in lx)
                assert abs(x.cumulative_logprob - y.cumulative_logprob) < 1e-3
    assert spec_llm.engine.stats()["spec_decode"]["acceptance_rate"] == 1.0
    assert spec_llm.engine.stats()["free_blocks"] == spec_llm.engine.runner.kv_spec.num_blocks


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_is_reproducible_across_runs_and_batches(tmp_path, method):
    family = "qwen2"
    path = write_checkpoint(tmp_path / "target", family, seed=1)
    draft = write_perturbed_draft(path, tmp_path / "draft")
    prompts = repetitive_prompts(random_prompts(6, seed=2, low=3, high=30))
    # Near-greedy requests (whose outputs repeat, so n-gram drafts get accepted) beside truly random ones;
    # a third with penalties, which must see earlier drafts as output.
    params = [SamplingParams(temperature=0.05 if i % 2 == 0 else 0.7, top_p=0.95, seed=100 + i, max_tokens=40,
                             presence_penalty=0.4 * (i % 3 == 1), repetition_penalty=1 + 0.2 * (i % 3 == 1))
              for i in range(len(prompts))]
    requests = [{"prompt_token_ids": p} for p in prompts]

    def run(order, llm):
        outs = llm.generate([requests[i] for i in order], [params[i] for i in order], use_tqdm=False)
        return {i: o.outputs[0].token_ids for i, o in zip(order, outs)}

    llm = make_llm(family, path, speculative_config=spec(method, 3, draft))
    first = run(range(len(prompts)), llm)
    assert run(range(len(prompts)), llm) == first
    assert run([4, 1, 3], llm) == {i: first[i] for i in (4, 1, 3)}
    assert run([2], make_llm(family, path, speculative_config=spec(method, 3, draft))) == {2: first[2]}
    assert llm.engine.stats()["spec_decode"]["num_accepted_tokens"] > 0
    if method == "ngram":
        # One-hot drafts are verified with plain sampling's own noise: the very tokens of plain sampling.
        assert run(range(len(prompts)), make_llm(family, path)) == first
