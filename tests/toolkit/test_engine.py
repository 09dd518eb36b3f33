"""The engine end to end on a tiny checkpoint: text prompts, chat, sampling, n, logprobs, errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import hf_greedy, random_prompts, write_checkpoint, write_tokenizer
from toolkit import LLM, SamplingParams
from toolkit.config import UnsupportedModelError
from toolkit.weights import CheckpointError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("llama"), "llama3", seed=3)
    return write_tokenizer(path)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=96, seed=0)


def test_text_prompts_match_transformers_and_decode(llm, ckpt):
    tok = llm.get_tokenizer()
    prompts = ["the cat sat on", "a list comprehension", "hello world"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    expected = hf_greedy(ckpt, [tok(p)["input_ids"] for p in prompts], 12)
    for prompt, out, exp in zip(prompts, outs, expected):
        assert out.prompt == prompt
        assert out.outputs[0].token_ids == exp
        # A character still incomplete when generation ends is held back, not shown as U+FFFD.
        assert out.outputs[0].text == tok.decode(exp, skip_special_tokens=True).rstrip("\ufffd")
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_prefill_chunks_through_aten_flash_attention_match_transformers(ckpt):
    """cpu_prefill_attention="flash" sends every request step of 2+ tokens to ATen's flash attention on
    its gathered K/V: first chunks, later chunks of a prompt split by the token budget, and suffixes over
    a prefix-cache hit, each beside decodes in one batch; and the three requests over the shared prefix's
    blocks (their suffixes, then their decodes) attend to them together (cascade)."""
    shared = random_prompts(1, seed=8, low=40, high=40)[0]
    prompts = [shared + p for p in random_prompts(4, seed=9, low=3, high=30)]
    llm = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=96, seed=0, max_num_batched_tokens=24,
              cpu_prefill_attention="flash")
    assert llm.engine.stats()["backend"]["prefill_attention"].startswith(
        "prefill attention: ATen's flash attention for chunks of 2+ tokens")
    params = SamplingParams(temperature=0, max_tokens=8)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == hf_greedy(ckpt, prompts, 8)
    assert all(o.num_cached_tokens >= 32 for o in rest)  # the shared prefix's whole blocks were hits


def test_outputs_in_input_order_with_mixed_lengths(llm):
    prompts = random_prompts(6, seed=5, low=2, high=30)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=2 + 3 * i) for i in range(6)], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [2 + 3 * i for i in range(6)]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_seeded_sampling_is_reproducible_and_n_samples_differ(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, n=3)
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    a = llm.generate(prompt, params, use_tqdm=False)[0]
    # Other requests in the batch must not change a seeded request's tokens.
    b = llm.generate(prompt + [{"prompt_token_ids": [9, 10]}], params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3


def test_logprobs_are_the_models_log_softmax(llm, ckpt):
    from transformers import AutoModelForCausalLM

    prompt = [5, 6, 7, 8, 9]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert token in lp and len(lp) >= 3
        for t, value in lp.items():
            assert value.logprob == pytest.approx(row[t].item(), abs=1e-4)
            assert value.decoded_token == llm.get_tokenizer().decode([t])
    assert out.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)), abs=1e-5)


def test_stop_string_truncates_text(llm):
    greedy = llm.generate(["the cat"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    text = greedy.text
    assert len(text) > 4
    stop = text[2:4]
    out = llm.generate(["the cat"], SamplingParams(temperature=0, max_tokens=20, stop=[stop]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)]


def test_stop_token_ids_and_min_tokens(ckpt):
    llm = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=64)
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
    # The first token that did not appear before it: stopping on it must cut exactly there.
    k = next(i for i in range(1, len(first)) if first[i] not in first[:i])
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first[k]]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == first[: k + 1] and out.finish_reason == "stop" and out.stop_reason == first[k]
    eos = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    real_eos, llm.engine.eos_token_ids = llm.engine.eos_token_ids, frozenset({first[k]})  # as if EOS came there
    at_eos = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    llm.engine.eos_token_ids = real_eos  # vLLM's stop_reason for EOS is None
    assert at_eos.token_ids == first[: k + 1] and at_eos.finish_reason == "stop" and at_eos.stop_reason is None
    assert eos[0].outputs[0].token_ids == first
    delayed = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, min_tokens=8, stop_token_ids=[first[k]]),
                           use_tqdm=False)[0].outputs[0]
    assert delayed.token_ids == first and delayed.finish_reason == "length"


def test_chat_uses_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hello world"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert tok.decode(out.prompt_token_ids) == "<|user|>hello world</s><|assistant|>"


def test_bad_prompts_raise_before_any_work(llm):
    long_prompt = {"prompt_token_ids": list(range(3, 3 + 97))}
    with pytest.raises(ValueError, match="prompt 1 has 97 tokens, more than max_model_len 96"):
        llm.generate([{"prompt_token_ids": [5]}, long_prompt], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate(["the cat", ""], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: prompt_token_ids must be a list of ints, got str"):
        llm.generate([{"prompt_token_ids": "abc"}], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 1: prompt_token_ids must hold ints, got float 1.5"):
        llm.generate([{"prompt_token_ids": [5]}, {"prompt_token_ids": [1.5, 2]}], use_tqdm=False)
    with pytest.raises(ValueError, match="conversation 0: messages\\[0\\] must be an object with a string role"):
        llm.chat([{"role": "user"}], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids must be ints, got bool"):
        llm.engine.add_request("direct", [True], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [10**6]}], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_bad_sampling_params_and_priorities_raise_before_any_request_is_added(llm):
    changed = SamplingParams(max_tokens=4)
    changed.n = 0  # after construction: caught when the request is added, not hung on
    prompts = [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7]}]
    with pytest.raises(ValueError, match="sampling_params 1: n must be an int >= 1"):
        llm.generate(prompts, [SamplingParams(max_tokens=4), changed], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params 0 must be a SamplingParams"):
        llm.generate(prompts[:1], [{"max_tokens": 4}], use_tqdm=False)
    with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
        llm.generate(prompts, SamplingParams(max_tokens=4), priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.generate(prompts, SamplingParams(max_tokens=4), priority=[1, 0], use_tqdm=False)
    with pytest.raises(ValueError, match="n must be"):
        llm.engine.add_request("direct", [5, 6], changed)
    assert not llm.engine.has_unfinished()  # nothing half-added: the engine goes on
    out = llm.generate(prompts, SamplingParams(max_tokens=4, seed=2**64 - 1, n=2, temperature=1.0), use_tqdm=False)
    assert [len(c.token_ids) for o in out for c in o.outputs] == [4, 4, 4, 4]


def test_a_separate_tokenizer_folder_is_honoured(ckpt, llm, tmp_path):
    bare = write_checkpoint(tmp_path / "bare", "llama3", seed=3)  # the same weights, no tokenizer files
    separate = LLM(str(bare), dtype="float32", enforce_eager=True, max_model_len=96, tokenizer=str(ckpt))
    params = SamplingParams(temperature=0, max_tokens=4)
    assert (separate.generate(["the cat sat on"], params, use_tqdm=False)[0].outputs[0].text
            == llm.generate(["the cat sat on"], params, use_tqdm=False)[0].outputs[0].text)
    with pytest.raises(FileNotFoundError, match="has none of tokenizer.json"):
        LLM(str(bare), dtype="float32", enforce_eager=True, max_model_len=96, tokenizer=str(tmp_path))


def test_a_device_this_torch_cannot_run_is_refused_before_loading(ckpt, monkeypatch):
    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N, got 'tpu'"):
        LLM(str(ckpt), device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda' is not available"):
            LLM(str(ckpt), device="cuda")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match="attention_backend='triton' needs a CUDA device"):
            LLM(str(ckpt), attention_backend="triton")


def test_without_a_cpp_compiler_the_engine_runs_eagerly_with_one_warning(ckpt, llm, monkeypatch, caplog):
    import logging
    import warnings

    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with caplog.at_level(logging.WARNING, logger="toolkit"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the CPU kernels cannot build either: their own warning
        eager = LLM(str(ckpt), dtype="float32", max_model_len=96)  # compiled by default
    assert eager.engine.config.enforce_eager
    assert sum("no C++ compiler" in r.getMessage() for r in caplog.records) == 1
    params = SamplingParams(temperature=0, max_tokens=4)
    assert (eager.generate(["the cat"], params, use_tqdm=False)[0].outputs[0].token_ids
            == llm.generate(["the cat"], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_request_that_can_never_fit_fails_alone(ckpt):
    # 4 blocks of 16 tokens: a 40-token prompt with 40 new tokens needs 5.
    bytes_per_token = 2 * 2 * 2 * 16 * 4
    llm = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=96,
              kv_cache_memory_bytes=4 * 16 * bytes_per_token)
    outs = llm.generate([{"prompt_token_ids": [5] * 10}, {"prompt_token_ids": [6] * 40}, {"prompt_token_ids": [7] * 5}],
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert "KV" in outs[1].error and outs[0].error is None
    assert [len(o.outputs[0].token_ids) for o in outs] == [40, 0, 40]


def test_checkpoint_errors_name_the_problem(ckpt, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = load_file(bad / "model.safetensors")

    def rewrite(tensors):
        save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})

    rewrite({k: v for k, v in weights.items() if k != "model.norm.weight"})
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        LLM(str(bad), enforce_eager=True)
    rewrite({**weights, "model.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.extra.weight'"):
        LLM(str(bad), enforce_eager=True)
    rewrite({**weights, "model.norm.weight": torch.zeros(3)})
    with pytest.raises(CheckpointError, match=r"shape mismatch for 'model.norm.weight'.*\(3,\).*\(64,\)"):
        LLM(str(bad), enforce_eager=True)
    (bad / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        LLM(str(bad), enforce_eager=True)
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        LLM(str(tmp_path / "nowhere"))


def test_sharded_checkpoint_loads(ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(ckpt).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    a = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=64)
    b = LLM(str(sharded), dtype="float32", enforce_eager=True, max_model_len=64)
    p = [{"prompt_token_ids": [5, 6, 7]}]
    sp = SamplingParams(temperature=0, max_tokens=8)
    assert a.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids == b.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[-1]
    (sharded / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing):
        LLM(str(sharded), enforce_eager=True)


def test_unsupported_configs_are_named(ckpt, tmp_path):
    def variant(name, **changes):
        path = tmp_path / name
        path.mkdir()
        for f in ckpt.iterdir():
            (path / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(changes)
        (path / "config.json").write_text(json.dumps(cfg))
        return str(path)

    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(variant("arch", architectures=["GPT2LMHeadModel"]))
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        LLM(variant("rope", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        LLM(variant("sw", architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=32),
            max_model_len=64)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(ckpt), dtype="float8")


def test_dtypes_load(ckpt):
    for dtype, torch_dtype in [("bfloat16", torch.bfloat16), ("auto", torch.float32)]:
        llm = LLM(str(ckpt), dtype=dtype, enforce_eager=True, max_model_len=64)
        assert llm.engine.runner.model.model.norm.weight.dtype == torch_dtype
        # Every linear runs the CPU kernel's op: qkv, o, gate_up, down per layer, and the lm_head.
        assert llm.engine.stats()["backend"]["packed_linears"] == 4 * llm.engine.model_config.num_layers + 1
        out = llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_engine_config_names_a_bad_field_or_environment_default(monkeypatch):
    from toolkit import EngineConfig

    for field, value, match in [("block_size", 0, "block_size must be an integer >= 1"),
                                ("max_num_seqs", True, "max_num_seqs must be an integer >= 1"),
                                ("attention_backend", "flash", "attention_backend must be one of torch, triton, cpu"),
                                ("cpu_linear", "fast", "cpu_linear must be one of auto, panel, onednn, torch"),
                                ("cpu_prefill_attention", "sdpa", "cpu_prefill_attention must be one of auto, flash, tiles"),
                                ("kv_cache_memory_fraction", 1.5, "kv_cache_memory_fraction must be in")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(model="m", **{field: value})
    monkeypatch.setenv("TOOLKIT_CPU_LINEAR", "fast")
    with pytest.raises(ValueError, match="TOOLKIT_CPU_LINEAR must be one of"):
        EngineConfig(model="m")
    monkeypatch.setenv("TOOLKIT_CPU_LINEAR", "panel")
    monkeypatch.setenv("TOOLKIT_CPU_KERNELS", "0")
    config = EngineConfig(model="m")
    assert (config.cpu_linear, config.cpu_kernels) == ("panel", False)  # the environment sets defaults
    assert EngineConfig(model="m", cpu_kernels=True).cpu_kernels  # and a field given wins
    monkeypatch.setenv("TOOLKIT_CPU_KERNELS", "maybe")
    with pytest.raises(ValueError, match="TOOLKIT_CPU_KERNELS must be 0 or 1"):
        EngineConfig(model="m")
