"""What a vLLM user reaches for: LLM's keyword arguments, logit_bias and allowed_token_ids (checked against
transformers' logits, the sampled distribution by a chi-square test), default sampling parameters from
generation_config.json, and priority without the priority policy."""

from __future__ import annotations

import functools
import itertools
import json
import logging

import pytest
import torch

from tests.checkpoints import VOCAB, hf_greedy, write_checkpoint
from tests.speculative.goodness_of_fit import ALPHA, chi_square_p_value
from toolkit import LLM, SamplingParams
from toolkit.config import UnsupportedModelError
from toolkit.runner import utilization_budget

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY_VOCAB = 8
PROMPT = [3, 4, 5, 3, 4]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama3", seed=3)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=96, skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-vocab")
    target = write_checkpoint(root / "target", "llama3", seed=1, vocab_size=TINY_VOCAB)
    draft = write_checkpoint(root / "draft", "llama3", seed=9, vocab_size=TINY_VOCAB, num_hidden_layers=1)
    return target, draft


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


@torch.no_grad()
def hf_next_logits(path, sequences: list[list[int]]) -> torch.Tensor:
    """transformers' float64 next-token logits after each sequence (all of one length), [N, V]."""
    return hf_model(str(path))(input_ids=torch.tensor(sequences)).logits[:, -1]


def hf_greedy_allowed(path, prompt: list[int], allowed: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        logits = hf_next_logits(path, [ids])[0]
        ids.append(allowed[int(logits[allowed].argmax())])
    return ids[len(prompt):]


def bias_vector(bias: dict[int, float], allowed: list[int] | None = None) -> torch.Tensor:
    add = torch.zeros(TINY_VOCAB, dtype=torch.float64)
    if allowed is not None:
        add[:] = float("-inf")
        add[allowed] = 0.0
    for t, b in bias.items():
        add[t] += b
    return add


def exact_joint(path, add: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """P(x1..xn | PROMPT) at temperature 1 of softmax(logits + add) at every step, as [V] * n."""
    joint = torch.ones((), dtype=torch.float64)
    for length in range(num_tokens):
        prefixes = [list(p) for p in itertools.product(range(TINY_VOCAB), repeat=length)]
        logits = hf_next_logits(path, [PROMPT + p for p in prefixes])
        nxt = (logits + add).softmax(-1).view(*([TINY_VOCAB] * length), TINY_VOCAB)
        joint = joint.unsqueeze(-1) * nxt
    return joint


# --- logit_bias and allowed_token_ids ---------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(logit_bias=[1, 2]), "logit_bias must be a dict"),
    (dict(logit_bias={"abc": 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias={True: 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias={5: float("nan")}), r"logit_bias\[5\] must be a finite number"),
    (dict(logit_bias={5: float("-inf")}), r"logit_bias\[5\] must be a finite number"),
    (dict(logit_bias={5: "1"}), r"logit_bias\[5\] must be a finite number"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be None or a non-empty list"),
    (dict(allowed_token_ids=5), "allowed_token_ids must be None or a non-empty list"),
    (dict(allowed_token_ids=[3, 1.5]), "allowed_token_ids must hold ints >= 0"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids must hold ints >= 0"),
])
def test_bad_logit_bias_and_allowed_ids_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_json_string_keys_become_token_ids():
    params = SamplingParams(logit_bias={"5": 1, 7: -2.5}, allowed_token_ids=(3, 4))
    assert params.logit_bias == {5: 1.0, 7: -2.5} and params.allowed_token_ids == [3, 4]


@pytest.mark.parametrize("kwargs", [dict(allowed_token_ids=[3, VOCAB]), dict(logit_bias={VOCAB + 7: 1.0})])
def test_ids_outside_the_vocabulary_fail_before_anything_runs(llm, kwargs):
    field = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"sampling_params 1: {field} has token ids outside the vocabulary"):
        llm.generate([{"prompt_token_ids": PROMPT}] * 2, [SamplingParams(), SamplingParams(**kwargs)], use_tqdm=False)
    with pytest.raises(ValueError, match=f"{field} has token ids outside the vocabulary"):
        llm.engine.add_request("direct", PROMPT, SamplingParams(**kwargs))
    assert not llm.engine.has_unfinished()


def test_greedy_with_allowed_ids_is_the_argmax_over_them(llm, ckpt):
    allowed = torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(0))[:20].add(3).tolist()
    prompts = [PROMPT, [7, 8, 9, 10, 11, 12]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": PROMPT}],
                        [SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed)] * 2
                        + [SamplingParams(temperature=0, max_tokens=8)], use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert set(out.outputs[0].token_ids) <= set(allowed)
        assert out.outputs[0].token_ids == hf_greedy_allowed(ckpt, prompt, allowed, 8)
    # The unconstrained request in the same batch is untouched.
    assert outs[2].outputs[0].token_ids == hf_greedy(ckpt, [PROMPT], 8)[0]


def test_greedy_logit_bias_moves_the_argmax(llm, ckpt):
    logits = hf_next_logits(ckpt, [PROMPT])[0]
    second = int(logits.topk(2).indices[1])
    gap = float(logits.max() - logits[second])
    out = llm.generate([{"prompt_token_ids": PROMPT}] * 2,
                       [SamplingParams(temperature=0, max_tokens=1, logit_bias={second: gap + 0.5}),
                        SamplingParams(temperature=0, max_tokens=1, logit_bias={str(second): gap - 0.5})],
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == [second]
    assert out[1].outputs[0].token_ids == [int(logits.argmax())]


def test_sampling_with_logit_bias_and_allowed_ids_has_the_exact_distribution(tiny):
    target, _ = tiny
    bias, allowed = {0: 1.5, 6: -2.0, 7: 2.5}, [0, 1, 3, 4, 6, 7]
    llm = LLM(str(target), dtype="float32", max_model_len=32, enforce_eager=True, skip_tokenizer_init=True, seed=4)
    samples = 4000
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * samples,
                        SamplingParams(max_tokens=1, ignore_eos=True, logit_bias=bias, allowed_token_ids=allowed),
                        use_tqdm=False)
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outs]), minlength=TINY_VOCAB)
    assert chi_square_p_value(counts, exact_joint(target, bias_vector(bias, allowed), 1)) > ALPHA
    # The test has power: the unbiased distribution over the allowed ids is rejected on the same data.
    assert chi_square_p_value(counts, exact_joint(target, bias_vector({}, allowed), 1)) < 1e-6


def test_speculative_rejection_sampling_keeps_the_biased_distribution(tiny):
    """A draft model's drafts are tested against p = softmax(logits + bias), so the output's joint
    distribution is the biased target's (as tests/speculative/test_distribution.py does unbiased)."""
    target, draft = tiny
    bias = {0: 2.0, 2: -1.0, 5: 1.5}
    llm = LLM(str(target), dtype="float32", max_model_len=32, enforce_eager=True, skip_tokenizer_init=True, seed=6,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    samples, num_tokens = 4000, 3
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * samples,
                        SamplingParams(max_tokens=num_tokens, ignore_eos=True, logit_bias=bias), use_tqdm=False)
    seqs = torch.tensor([o.outputs[0].token_ids for o in outs])
    stats = llm.engine.stats()["spec_decode"]
    assert stats["num_drafts"] > samples // 2 and 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    counts = torch.bincount(seqs[:, 0] * TINY_VOCAB**2 + seqs[:, 1] * TINY_VOCAB + seqs[:, 2],
                            minlength=TINY_VOCAB**3)
    assert chi_square_p_value(counts, exact_joint(target, bias_vector(bias), num_tokens)) > ALPHA
    assert chi_square_p_value(counts, exact_joint(target, bias_vector({}), num_tokens)) < 1e-6


def test_greedy_allowed_ids_through_draft_model_speculation(ckpt, tmp_path):
    from tests.speculative.checkpoints import write_perturbed_draft

    draft = write_perturbed_draft(ckpt, tmp_path / "draft")
    llm = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=64, skip_tokenizer_init=True,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    allowed = list(range(3, 60))
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       SamplingParams(temperature=0, max_tokens=10, allowed_token_ids=allowed), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy_allowed(ckpt, PROMPT, allowed, 10)
    assert llm.engine.stats()["spec_decode"]["num_drafts"] > 0


def test_cli_lines_take_logit_bias_and_allowed_ids():
    from toolkit.cli.jobs import jsonl_job
    from toolkit.cli.openai_batch import parse_request

    base = SamplingParams()
    job = jsonl_job(1, b'{"prompt": "hi", "logit_bias": {"5": -100}, "allowed_token_ids": [5, 6]}', base)
    assert job.error is None and job.params.logit_bias == {5: -100.0} and job.params.allowed_token_ids == [5, 6]
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "hi", "logit_bias": {"50": 3}, "allowed_token_ids": [50, 51]}}
    job = parse_request(1, json.dumps(line).encode(), base)
    assert job.error is None and job.params.logit_bias == {50: 3.0} and job.params.allowed_token_ids == [50, 51]
    line["body"]["logit_bias"] = {"x": 1}
    assert "logit_bias keys must be token ids" in parse_request(2, json.dumps(line).encode(), base).error


def test_cli_line_with_ids_outside_the_vocabulary_is_a_line_error(llm):
    from toolkit.cli.jobs import LineError, encode, jsonl_job

    raw = json.dumps({"prompt_token_ids": PROMPT, "allowed_token_ids": [3, VOCAB]}).encode()
    with pytest.raises(LineError, match="allowed_token_ids has token ids outside the vocabulary"):
        encode(llm.engine, jsonl_job(1, raw, SamplingParams()))


# --- LLM's keyword arguments -------------------------------------------------------------------


def test_vllms_keywords_are_accepted_and_mapped(ckpt, caplog):
    with caplog.at_level(logging.WARNING, logger="toolkit"):
        llm = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=64, skip_tokenizer_init=True,
                  gpu_memory_utilization=0.5, trust_remote_code=True, seed=3, tensor_parallel_size=1,
                  pipeline_parallel_size=1, max_num_seqs=8, max_num_batched_tokens=32, enable_prefix_caching=False,
                  block_size=8, swap_space=4, tokenizer_mode="auto", revision=None, tokenizer_revision=None,
                  download_dir=None, disable_log_stats=True, kv_cache_dtype="auto", quantization=None,
                  enable_chunked_prefill=True, cpu_offload_gb=0, disable_custom_all_reduce=True)
    c = llm.engine.config
    assert (c.max_num_seqs, c.max_num_batched_tokens, c.block_size, c.max_model_len, c.seed) == (8, 32, 8, 64, 3)
    assert not c.enable_prefix_caching and c.enforce_eager and c.dtype == torch.float32
    assert "gpu_memory_utilization=0.5 does not apply on cpu" in caplog.text
    # A 40-token prompt is chunked by the 32-token budget and still matches transformers.
    prompt = list(range(3, 43))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(ckpt, [prompt], 6)[0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(revision="main"), r"revision='main' is not supported: the toolkit loads a local folder"),
    (dict(tokenizer_revision="v1"), r"tokenizer_revision='v1' is not supported: the toolkit loads a local folder"),
    (dict(download_dir="/tmp/hf"), r"download_dir='/tmp/hf' is not supported"),
    (dict(quantization="awq"), r"quantization='awq' is not supported: .*not implemented"),
    (dict(kv_cache_dtype="fp8"), r"kv_cache_dtype='fp8' is not supported: must be 'auto'"),
    (dict(cpu_offload_gb=4), r"cpu_offload_gb=4 is not supported"),
    (dict(enable_chunked_prefill=False), r"enable_chunked_prefill=False is not supported: long prefills"),
    (dict(tokenizer_mode="slow"), r"tokenizer_mode='slow' is not supported"),
    (dict(pipeline_parallel_size=0), r"pipeline_parallel_size must be an integer >= 1"),
    (dict(prefill_instances=1, decode_instances=1, prefill_pipeline_parallel_size=0),
     r"prefill_pipeline_parallel_size must be an integer >= 1"),
    (dict(prefill_pipeline_parallel_size=2), r"prefill_pipeline_parallel_size needs prefill_instances and decode"),
    (dict(max_local_prefill_tokens=16), r"max_local_prefill_tokens needs prefill_instances and decode_instances"),
    (dict(prefill_instances=1, decode_instances=1, max_local_prefill_tokens=-1),
     r"max_local_prefill_tokens must be an integer >= 0"),
    (dict(decode_token_cost=2.0), r"decode_token_cost needs prefill_instances and decode_instances"),
    (dict(prefill_instances=1, decode_instances=1, decode_token_cost=-1), r"decode_token_cost must be a finite number"),
    (dict(prefill_instances=1, decode_instances=1, decode_token_cost=float("nan")),
     r"decode_token_cost must be a finite number"),
    (dict(pipeline_parallel_size=2, pp_layer_partition=[1, 1]), r"pp_layer_partition must be a string"),
    (dict(prefill_instances=1), r"prefill_instances 1 and decode_instances 0: disaggregation needs at least one"),
    (dict(prefill_instances=-1, decode_instances=1), r"prefill_instances must be an integer >= 0"),
    (dict(prefill_tensor_parallel_size=2), r"prefill_tensor_parallel_size needs prefill_instances and decode_inst"),
    (dict(prefill_instances=1, decode_instances=1, prefill_tensor_parallel_size=0),
     r"prefill_tensor_parallel_size must be an integer >= 1"),
    (dict(prefill_instances=1, decode_instances=1, prefill_tensor_parallel_size=2, quantization="int8"),
     r"quantization='int8' does not combine with prefill_tensor_parallel_size > 1 yet"),
    (dict(swap_space=-1), r"swap_space=-1 is not supported: must be a number of GiB >= 0"),
    (dict(disable_log_stats="yes"), r"disable_log_stats='yes' is not supported: must be a bool"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(gpu_memory_utilization=0.8, kv_cache_memory_fraction=0.5), r"gpu_memory_utilization and kv_cache_memory"),
    (dict(trust_remote_code="yes"), r"trust_remote_code must be a bool"),
    (dict(seed=1.5), r"seed must be None or an int"),
])
def test_vllms_keywords_that_cannot_apply_are_errors_naming_them(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), **kwargs)  # before anything is loaded: the folder is empty


def test_unknown_keywords_stay_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="gpu_memory_utilisation"):
        LLM(str(tmp_path), gpu_memory_utilisation=0.9)


def test_gpu_memory_utilization_is_a_share_of_total_memory():
    gib = 2**30
    # 80 GiB GPU, 20 GiB in use (weights): 0.9 of it leaves 72 - 20 GiB for the KV cache.
    assert utilization_budget(60 * gib, 80 * gib, 0.9) == int(0.9 * 80 * gib) - 20 * gib
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.2 allows 16.00 GiB .* 20.00 GiB are in use"):
        utilization_budget(60 * gib, 80 * gib, 0.2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_memory_utilization_on_cuda(ckpt):
    kwargs = dict(dtype="float32", enforce_eager=True, max_model_len=64, skip_tokenizer_init=True, device="cuda")
    llm = LLM(str(ckpt), gpu_memory_utilization=0.9, **kwargs)
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(ckpt, [PROMPT], 4)[0]
    free, total = torch.cuda.mem_get_info()
    with pytest.raises(ValueError, match="are in use already"):  # less than what is already in use
        LLM(str(ckpt), gpu_memory_utilization=(total - free) / total / 2, **kwargs)


def _write_config(path, **fields):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                                                  "num_hidden_layers": 1, "intermediate_size": 128, **fields}))
    return path


def test_trust_remote_code_never_runs_the_checkpoints_code(tmp_path):
    unsupported = _write_config(tmp_path / "unsupported", architectures=["FalconForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM.*trust_remote_code=True cannot help"):
        LLM(str(unsupported), trust_remote_code=True)
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM") as e:
        LLM(str(unsupported))
    assert "cannot help" not in str(e.value)
    # A checkpoint that brings its own code: refused by name, and its code is never imported.
    custom = _write_config(tmp_path / "custom", model_type="my_model", architectures=["MyForCausalLM"],
                           auto_map={"AutoConfig": "configuration_my.MyConfig"})
    marker = tmp_path / "ran"
    (custom / "configuration_my.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(UnsupportedModelError, match="MyForCausalLM.*trust_remote_code=True cannot help"):
        LLM(str(custom), trust_remote_code=True)
    assert not marker.exists()


def test_engine_seed_is_the_default_for_unseeded_requests(ckpt):
    def sample(seed):
        llm = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=64, skip_tokenizer_init=True, seed=seed)
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * 3, SamplingParams(temperature=1.0, max_tokens=8),
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    first = sample(11)
    assert sample(11) == first
    assert sample(12) != first


# --- default sampling parameters ---------------------------------------------------------------


@pytest.fixture
def gen_ckpt(ckpt, tmp_path):
    """The module's weights in a folder of the test's own, whose generation_config.json the test writes."""
    import shutil

    path = tmp_path / "model"
    shutil.copytree(ckpt, path)
    return path


def _generation_config(path, **fields):
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **fields}))


def _llm(path, **kwargs):
    return LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=64, skip_tokenizer_init=True, **kwargs)


def test_default_sampling_params_come_from_generation_config(gen_ckpt):
    _generation_config(gen_ckpt, do_sample=True, temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                       repetition_penalty=1.1, max_new_tokens=7, num_beams=1)
    params = _llm(gen_ckpt).get_default_sampling_params()
    expected = SamplingParams(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=7)
    assert params == expected


def test_generate_without_sampling_params_uses_them(gen_ckpt):
    _generation_config(gen_ckpt, top_k=1, max_new_tokens=5)  # top_k 1: greedy, so transformers is the oracle
    llm = _llm(gen_ckpt)
    prompts = [PROMPT, [9, 10, 11]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(gen_ckpt, prompts, 5)


def test_without_generation_defaults_vllms_defaults_apply(gen_ckpt, tmp_path):
    assert _llm(gen_ckpt).get_default_sampling_params() == SamplingParams()  # the file sets only token ids
    _generation_config(gen_ckpt, temperature=0.3, max_new_tokens=9)
    assert _llm(gen_ckpt, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    other = tmp_path / "other"
    other.mkdir()
    _generation_config(other, top_p=0.5)
    assert _llm(gen_ckpt, generation_config=str(other)).get_default_sampling_params() == SamplingParams(top_p=0.5)
    with pytest.raises(FileNotFoundError, match="generation_config="):
        _llm(gen_ckpt, generation_config=str(tmp_path / "missing"))


def test_bad_generation_config_fails_at_start_naming_the_file(gen_ckpt):
    _generation_config(gen_ckpt, top_p=0.0)
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be in \(0, 1\]"):
        _llm(gen_ckpt)


# --- priority ----------------------------------------------------------------------------------


def test_priority_without_the_priority_policy_is_an_error(llm):
    prompts = [{"prompt_token_ids": PROMPT}] * 2
    with pytest.raises(ValueError, match="priority is set but scheduling_policy is 'fcfs'"):
        llm.generate(prompts, SamplingParams(max_tokens=1), priority=[0, 1], use_tqdm=False)
    with pytest.raises(ValueError, match="has priority 3 but scheduling_policy is 'fcfs'"):
        llm.engine.add_request("p", PROMPT, SamplingParams(max_tokens=1), priority=3)
    assert not llm.engine.has_unfinished()
    # All zeros is no priority at all (vLLM's rule too).
    assert len(llm.generate(prompts, SamplingParams(max_tokens=1), priority=[0, 0], use_tqdm=False)) == 2


def _feature_kwargs(name: str, tmp_path) -> dict:
    """EngineConfig keywords that turn one of config.FEATURES on."""
    return {
        "disaggregated prefill/decode": dict(prefill_instances=1, decode_instances=1),
        "tensor_parallel_size": dict(tensor_parallel_size=2),
        "data_parallel_size": dict(data_parallel_size=2),
        "pipeline_parallel_size": dict(pipeline_parallel_size=2),
        "enable_expert_parallel": dict(enable_expert_parallel=True),
        "speculative_config": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
        "kv_offloading_size": dict(kv_offloading_size=0.01),
        "kv_disk_cache_dir": dict(kv_disk_cache_dir=str(tmp_path / "kv")),
        "preemption_mode='swap'": dict(preemption_mode="swap", kv_offloading_size=0.01),
        "enable_prefix_caching": dict(enable_prefix_caching=True),
        "max_num_batched_tokens": dict(max_num_batched_tokens=16),
        "quantization='int8'": dict(quantization="int8"),
    }[name]


def test_the_combinability_table_is_what_the_config_accepts(tmp_path):
    """Every pair of features: the config accepts it exactly when NOT_COMBINED does not list it, and a
    refusal names both features. (Pipeline parallelism combines with everything.)"""
    import dataclasses
    from types import SimpleNamespace

    from toolkit.config import FEATURES, NOT_COMBINED, EngineConfig

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    accepted = 0
    for a, b in itertools.combinations(FEATURES, 2):
        kwargs = {**_feature_kwargs(a, tmp_path), **_feature_kwargs(b, tmp_path)}
        # what the keywords turn on (swap needs the CPU tier, so it sets kv_offloading_size too)
        on = [n for n, is_on in FEATURES.items() if is_on(SimpleNamespace(**{**defaults, **kwargs}))]
        if any(frozenset(p) in NOT_COMBINED for p in itertools.combinations(on, 2)):
            with pytest.raises(ValueError, match="does not combine with .*yet"):
                EngineConfig(model="-", **kwargs)
        else:
            EngineConfig(model="-", **kwargs)
            accepted += 1
    pipeline = [p for p in map(frozenset, itertools.combinations(FEATURES, 2)) if "pipeline_parallel_size" in p]
    assert [p for p in pipeline if p in NOT_COMBINED] == []
    assert accepted > 40
