"""The C++ decode step (toolkit/decode_step_cpu.py) against the model's own forward.

The oracle is the reference model (toolkit/models/llama.py, eager) on the same step: the logits and
every layer's KV cache. Float32 must agree up to summation order. In bf16 and fp16 there is no exact
answer: both are held against the float32 model on the same weights, and the C++ path must land as
near it as the reference does. Greedy tokens against
transformers, with the C++ path serving every decode step, are checked by tests/test_parity.py
(eager) and below (compiled).
"""

from __future__ import annotations

import logging

import pytest
import torch

from attention import AttentionMetadata
from scheduling import ScheduledRequest
from tests.checkpoints import hf_greedy, random_prompts, write_checkpoint
from toolkit import LLM, SamplingParams, decode_step_cpu, precompiled

BLOCK = 16
SEQ_LENS = [5, 16, 40]  # a partial block, a full one, several blocks


@pytest.fixture(scope="module", params=["llama3", "qwen2", "qwen3", "tied_mqa"])
def ckpt(request, tmp_path_factory):
    return request.param, write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)


def _runner(path, dtype="float32", **kwargs):
    return LLM(str(path), dtype=dtype, enforce_eager=True, max_model_len=128, block_size=BLOCK, **kwargs).engine.runner


def _step(runner, padding: int = 1, seed: int = 0):
    """A decode step over SEQ_LENS with random history in the caches, plus `padding` rows as prepare()
    pads them (token 0 at position 0, slot -1, length 1, block 0): the model's inputs but the caches."""
    g = torch.Generator().manual_seed(seed)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=g))
    width = max(-(-n // BLOCK) for n in SEQ_LENS)
    tables, next_block = [], 1
    for n in SEQ_LENS:
        blocks = -(-n // BLOCK)
        tables.append(list(range(next_block, next_block + blocks)) + [0] * (width - blocks))
        next_block += blocks
    slots = [tables[i][(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for i, n in enumerate(SEQ_LENS)]
    rows = len(SEQ_LENS) + padding
    meta = AttentionMetadata(
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.tensor(SEQ_LENS + [1] * padding, dtype=torch.int32),
        block_tables=torch.tensor(tables + [[0] * width] * padding, dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * padding),
        decode_only=True,
    )
    input_ids = torch.cat([torch.randint(0, runner.config.vocab_size, (len(SEQ_LENS),), generator=g),
                           torch.zeros(padding, dtype=torch.int64)])
    positions = torch.tensor([n - 1 for n in SEQ_LENS] + [0] * padding)
    return input_ids, positions, meta, torch.arange(len(SEQ_LENS))


def _decode(runner, input_ids, positions, meta, logits_indices, reference: bool):
    """The model on one step, as (logits, caches after): the installed forward or the reference, the
    runner's caches left as they were."""
    model, saved = runner.model, [c.clone() for c in runner.kv_caches]
    with torch.inference_mode():
        if reference:  # on the same list object (the C++ path takes only the runner's own)
            logits = type(model).forward(model, input_ids, positions, runner.kv_caches, meta, logits_indices)
        else:
            logits = model(input_ids, positions, runner.kv_caches, meta, logits_indices)
        after = [c.clone() for c in runner.kv_caches]
    for cache, before in zip(runner.kv_caches, saved):
        cache.copy_(before)
    return logits, after


def test_float32_decode_step_matches_the_reference_model(ckpt):
    family, path = ckpt
    runner = _runner(path)
    assert runner.decode_step is not None
    step = _step(runner)
    ours, our_caches = _decode(runner, *step, reference=False)
    theirs, their_caches = _decode(runner, *step, reference=True)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5, msg=family)
    for layer, (oc, tc) in enumerate(zip(our_caches, their_caches)):
        torch.testing.assert_close(oc, tc, atol=2e-5, rtol=1e-5, msg=f"{family} layer {layer} KV cache")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_decode_step_is_as_near_the_float32_model_as_the_reference(ckpt, dtype):
    family, path = ckpt
    exact, runner = _runner(path), _runner(path, dtype)
    assert runner.decode_step is not None
    step = _step(runner)
    for half, full in zip(runner.kv_caches, exact.kv_caches):
        full.copy_(half.float())  # the same history, in float32
    truth, _ = _decode(exact, *step, reference=True)
    ours, _ = _decode(runner, *step, reference=False)
    theirs, _ = _decode(runner, *step, reference=True)
    ours_err, theirs_err = (ours - truth).abs().max().item(), (theirs - truth).abs().max().item()
    assert ours_err <= 1.5 * theirs_err + 1e-4, f"{family} {dtype}: {ours_err:.4f} against {theirs_err:.4f}"


def test_steps_it_does_not_take_run_the_forward_it_wrapped(ckpt, monkeypatch):
    _, path = ckpt
    runner = _runner(path)
    step = _step(runner, padding=0)
    meta = step[2]
    reference, _ = _decode(runner, *step, reference=True)

    def refuse(*args):
        raise AssertionError("the C++ path was called")

    monkeypatch.setattr(runner.decode_step, "kernel", refuse)
    meta.decode_only = False  # a mixed step (here every request happens to feed one token)
    torch.testing.assert_close(_decode(runner, *step, reference=False)[0], reference)
    meta.decode_only = True
    meta.seq_lens = meta.seq_lens.long()  # not what prepare() builds
    with pytest.raises(RuntimeError, match="not what the runner's prepare"):  # the runner's: strict
        _decode(runner, *step, reference=False)
    monkeypatch.setattr(runner.decode_step, "strict", False)  # as for a model wrapped outside a runner
    torch.testing.assert_close(_decode(runner, *step, reference=False)[0], reference)


def test_prepare_hands_it_decode_steps_unpadded_and_other_steps_padded(ckpt, monkeypatch):
    _, path = ckpt
    monkeypatch.setenv(precompiled.SWITCH, "0")  # compiled mode, without compiling anything here
    runner = LLM(str(path), dtype="float32", max_model_len=128, block_size=BLOCK).engine.runner
    decode = runner.prepare([ScheduledRequest("a", [5], 9, [0], True)])
    assert decode.decode_only and decode.input_ids.shape == (1,) and decode.meta.seq_lens.shape == (1,)
    mixed = runner.prepare([ScheduledRequest("a", [5], 0, [0], False)])  # a 1-token prefill chunk
    assert not mixed.decode_only and mixed.input_ids.shape == (2,)  # padded to MIN_BUCKET for the graphs
    monkeypatch.setenv(decode_step_cpu.SWITCH, "0")
    runner = LLM(str(path), dtype="float32", max_model_len=128, block_size=BLOCK).engine.runner
    assert runner.prepare([ScheduledRequest("a", [5], 9, [0], True)]).input_ids.shape == (2,)


def test_prepare_builds_decode_steps_as_the_general_path_does(ckpt, monkeypatch):
    # Oracle: the general path of prepare() (eager, so unpadded) on the same requests, every tensor.
    _, path = ckpt
    runner = _runner(path)
    batch = [ScheduledRequest("a", [5], 9, [3, 7], True), ScheduledRequest("b", [11], 16, [1, 4, 2], True),
             ScheduledRequest("c", [2], 40, [6, 8, 9, 5], True), ScheduledRequest("d", [0], 0, [10], True)]
    fast = runner._prepare_decode(batch)
    monkeypatch.setattr(runner, "decode_step", None)
    general = runner.prepare(batch)
    for name in ("input_ids", "positions", "logits_indices"):
        torch.testing.assert_close(getattr(fast, name), getattr(general, name), rtol=0, atol=0)
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        torch.testing.assert_close(getattr(fast.meta, name), getattr(general.meta, name), rtol=0, atol=0)
    assert fast.decode_only and general.decode_only and fast.num_tokens == general.num_tokens == 4
    assert fast.meta.backend == general.meta.backend
    # Any other step is the general path's; a block table short of the position is a scheduler bug.
    assert runner._prepare_decode([batch[0], ScheduledRequest("e", [1, 2], 0, [11], True)]) is None
    assert runner._prepare_decode([ScheduledRequest("f", [1], 3, [11], False)]) is None
    with pytest.raises(RuntimeError, match="does not reach position 16"):
        runner._prepare_decode([ScheduledRequest("g", [1], 16, [11], True)])


def test_bad_rows_raise_index_error(ckpt):
    _, path = ckpt
    runner = _runner(path)
    step = _step(runner)
    step[0][1] = runner.config.vocab_size
    with pytest.raises(IndexError, match="row 1 has a token id"):
        _decode(runner, *step, reference=False)
    step = _step(runner, padding=2)
    step[2].slot_mapping[1] = -1  # a real row without a slot, before the padding
    with pytest.raises(IndexError, match="row 1 has .* KV slot outside the cache"):
        _decode(runner, *step, reference=False)
    step = _step(runner)
    step[2].seq_lens[0] = BLOCK * step[2].block_tables.shape[1] + 1
    with pytest.raises(IndexError, match="past their block table"):
        _decode(runner, *step, reference=False)
    step = _step(runner)
    step[3][0] = len(SEQ_LENS)  # the padding row
    with pytest.raises(IndexError, match="logits index 0 is not one of the step's tokens"):
        _decode(runner, *step, reference=False)


def test_where_the_decode_step_is_installed(ckpt, monkeypatch, caplog):
    _, path = ckpt
    monkeypatch.setenv(decode_step_cpu.SWITCH, "0")
    assert _runner(path).decode_step is None
    monkeypatch.delenv(decode_step_cpu.SWITCH)
    with caplog.at_level(logging.INFO, logger="toolkit"):
        assert _runner(path, prepack_weights=False).decode_step is None  # plain nn.Linear weights
        assert _runner(path, attention_backend="triton").decode_step is None
    assert "not a panel linear" in caplog.text and "the triton attention backend" in caplog.text
    runner = _runner(path)
    model, caches = runner.model, runner.kv_caches
    assert decode_step_cpu.unsupported(model, caches) is None
    assert "KV cache" in decode_step_cpu.unsupported(model, [c[..., :8].contiguous() for c in caches])  # head_dim
    assert "not all one of" in decode_step_cpu.unsupported(model, [c.to(torch.bfloat16) for c in caches])
    assert "KV caches for" in decode_step_cpu.unsupported(model, caches[:1])


@pytest.mark.parametrize("precompile", ["1", "0"])  # saved graphs, or torch.compile's JIT path
def test_compiled_engine_serves_decode_steps_with_it_and_gives_transformers_tokens(precompile, tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    monkeypatch.setenv(precompiled.SWITCH, precompile)
    path = write_checkpoint(tmp_path / "qwen3", "qwen3", seed=5)
    prompts = random_prompts(4, seed=12, low=3, high=30)
    llm = LLM(str(path), dtype="float32", max_model_len=96, kv_cache_memory_bytes=1 << 22)
    calls, kernel = [], llm.engine.runner.decode_step.kernel
    monkeypatch.setattr(llm.engine.runner.decode_step, "kernel", lambda *a: calls.append(1) or kernel(*a))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=10),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 10)
    assert len(calls) >= 9  # every request's 9 decode tokens came from decode-only steps, in C++
    runner = llm.engine.runner
    assert runner.decode_step is not None
    if precompile == "1":
        assert runner.precompiled.sources == {"mixed": "compiled"}  # no decode-step graph was needed
    else:
        assert runner.precompiled is None
