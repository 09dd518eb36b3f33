"""An exception inside a step fails the requests of that step alone and leaves the engine usable.

Faults are injected where real ones come from (the model step before it writes any KV, the
detokenizer, the draft proposer); the oracle for everything that did not fail is transformers'
greedy tokens, and afterwards every KV block is free and no half-written block is reused.
"""

from __future__ import annotations

import pytest

from tests.checkpoints import hf_greedy, random_prompts, write_checkpoint
from toolkit import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama3", seed=11)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, seed=2, low=36, high=44)  # two full KV blocks each: prefix-cacheable


@pytest.fixture(scope="module")
def expected(ckpt, prompts):
    return hf_greedy(ckpt, prompts, 6)


def _llm(ckpt, **kw) -> LLM:
    return LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=96, max_num_seqs=2, **kw)


def _drain(engine) -> dict:
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    return outs


def _all_blocks_free(engine) -> bool:
    kv = engine.scheduler.kv_cache
    return kv.num_free_blocks == kv.num_blocks and not kv.owned_blocks()


def test_a_failed_model_step_fails_its_requests_alone(ckpt, prompts, expected):
    llm = _llm(ckpt)
    engine, real_execute = llm.engine, llm.engine.runner.execute
    armed = {"left": 1}

    def execute(inputs):
        if armed["left"]:  # before the real forward: the step's KV slots are never written
            armed["left"] -= 1
            raise RuntimeError("injected fault")
        return real_execute(inputs)

    engine.runner.execute = execute
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    outs = _drain(engine)
    # max_num_seqs=2: the first step held r0 and r1; r2 waited and must be untouched.
    for rid in ("r0", "r1"):
        assert outs[rid].outputs[0].finish_reason == "error"
        assert "injected fault" in outs[rid].error and "RuntimeError" in outs[rid].error
    assert outs["r2"].error is None and outs["r2"].outputs[0].token_ids == expected[2]
    assert _all_blocks_free(engine)
    # The engine goes on, and the failed prompts' never-written blocks were not cached for reuse.
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert all(o.num_cached_tokens == 0 for o in again[:2])
    assert _all_blocks_free(engine)


def test_a_failing_detokenizer_fails_only_its_request(ckpt, prompts, expected, tmp_path):
    from tests.checkpoints import write_tokenizer

    llm = _llm(write_tokenizer(write_checkpoint(tmp_path, "llama3", seed=11)))
    engine = llm.engine
    for i, p in enumerate(prompts[:2]):
        engine.add_request(f"r{i}", p, GREEDY)
    detok = engine.outputs.tracked["r1"].detokenizer

    def broken(tokens):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    detok.add_tokens = broken
    outs = _drain(engine)
    assert outs["r0"].error is None and outs["r0"].outputs[0].token_ids == expected[0]
    assert outs["r1"].outputs[0].finish_reason == "error" and "detokenizing" in outs["r1"].error
    assert _all_blocks_free(engine)


def test_a_failing_draft_proposer_fails_its_requests_and_the_engine_goes_on(ckpt, prompts, expected):
    llm = _llm(ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                         "prompt_lookup_max": 3})
    engine, real_propose = llm.engine, llm.engine.speculator.propose
    armed = {"left": 1}

    def propose(*args):
        if armed["left"]:
            armed["left"] -= 1
            raise MemoryError("injected")
        return real_propose(*args)

    engine.speculator.propose = propose
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    failed = [o for o in outs if o.error]
    assert failed and all("drafting failed" in o.error for o in failed)
    assert [o.outputs[0].token_ids for o in outs if not o.error] == [e for o, e in zip(outs, expected) if not o.error]
    assert _all_blocks_free(engine)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected


def test_an_interrupted_generate_leaves_nothing_in_the_engine(ckpt, prompts, expected):
    llm = _llm(ckpt)
    real_step, calls = llm.engine.step, {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_step()

    llm.engine.step = step
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished() and _all_blocks_free(llm.engine)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected
