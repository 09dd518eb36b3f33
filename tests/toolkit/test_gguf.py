"""GGUF checkpoints against transformers on the same de-quantized weights.

Each case writes a small seeded random model to a GGUF file as llama.cpp's converter does
(tests/gguf_files.py); the oracle is a transformers model holding the same weights, de-quantized
before any permutation (so it never runs the loader's un-permutation): greedy token ids exact and
prompt logits close, float32. The real SmolLM2 file is checked in test_real_model.py.
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from typer.testing import CliRunner

from tests.checkpoints import COMMON, random_prompts, write_tokenizer
from tests.gguf_files import K_DIMS, K_QUANTS, Q4_K_M, hf_greedy, k_quantize, llama_cpp_permute, write_gguf
from tests.toolkit.test_parity import first_diff, prefill_logits
from toolkit import LLM, SamplingParams, gguf_quants
from toolkit.cli.main import app
from toolkit.config import UnsupportedModelError, load_model_config
from toolkit.gguf_checkpoint import SUPPORTED_TYPES, GGUFTensors, unpermute_order
from toolkit.weights import CheckpointError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 16
# Every supported type on llama (its q/k permuted); the other families in one type each.
CASES = [("llama", t) for t in SUPPORTED_TYPES] + [("llama_tied_mqa", "Q8_0"), ("qwen2", "Q8_0"), ("qwen3", "Q4_1"),
                                                   ("qwen2", "Q4_K"), ("llama", "Q4_K_M")]
MIXES = {"Q4_K_M": ("Q4_K", Q4_K_M)}  # (base type, exceptions by tensor name)


def dims(qtype: str) -> dict:
    return K_DIMS if "_K" in qtype else {}


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=128, **kwargs)


@pytest.mark.parametrize("family,qtype", CASES)
def test_gguf_matches_transformers_on_the_dequantized_weights(family, qtype, tmp_path):
    path = tmp_path / f"{family}-{qtype}.gguf"
    base, mix = MIXES.get(qtype, (qtype, None))
    hf = write_gguf(path, family, base, seed=1, mix=mix, **dims(qtype))
    prompts = random_prompts(4, seed=2, low=3, high=40)
    llm = engine(path, skip_tokenizer_init=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    for i, (got, want) in enumerate(zip([o.outputs[0].token_ids for o in outs], hf_greedy(hf, prompts, NEW_TOKENS))):
        assert got == want, f"{family}/{qtype}: prompt {i} diverges at {first_diff(got, want)}"
    for prompt in prompts[:2]:
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(prefill_logits(llm.engine.runner, prompt), theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_transformers_reads_the_written_file_as_the_oracle_does(qtype, tmp_path):
    """The files follow llama.cpp's conventions (names, metadata, q/k permutation, block layouts) as
    transformers reads them, so agreeing with the oracle means agreeing with llama.cpp's files."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / "llama.gguf"
    oracle = write_gguf(path, "llama", qtype, seed=1, **dims(qtype)).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).state_dict()
    assert set(theirs) == set(oracle)
    for name, value in oracle.items():
        torch.testing.assert_close(theirs[name], value, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q6_K"])
def test_a_ranks_slice_reads_only_its_part_and_equals_the_whole_tensors(qtype, tmp_path):
    """Tensor-parallel slices: rows (q's permuted ones too), block-aligned and unaligned columns."""
    path = tmp_path / "llama.gguf"
    state = write_gguf(path, "llama", qtype, seed=1, **dims(qtype)).state_dict()
    block = GGML_QUANT_SIZES[Q[qtype]][0]
    tensors = GGUFTensors(path)
    assert set(tensors.keys()) == set(state)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        whole = state[name]
        sl = tensors.get_slice(name)
        assert sl.get_shape() == list(whole.shape)
        torch.testing.assert_close(sl[:], whole, atol=0, rtol=0)
        if whole.dim() == 1:
            torch.testing.assert_close(sl[(slice(3, 17),)], whole[3:17], atol=0, rtol=0)
            continue
        rows, cols = whole.shape
        aligned = [(slice(0, rows), slice(start, start + block)) for start in range(0, cols, block)]
        for index in [(slice(rows // 2, rows), slice(0, cols)), *aligned, (slice(8, 24), slice(5, 40)),
                      (slice(0, rows), slice(0, cols // 2))]:
            torch.testing.assert_close(sl[index], whole[index], atol=0, rtol=0, msg=f"{name}{index}")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_1", "F16", "F32"])
def test_torch_dequantization_is_ggufs_bit_for_bit(qtype):
    """toolkit/gguf_quants.py against gguf.quants on random blocks: every byte of the quants drawn, and
    scales and minimums over float16's range (negative, zero, subnormal, large)."""
    rng = np.random.default_rng(0)
    size, block_bytes = GGML_QUANT_SIZES[Q[qtype]]
    raw = rng.integers(0, 256, (7, 9 * block_bytes), dtype=np.uint8)
    if qtype.startswith("Q"):
        heads = {"Q4_1": 2, "Q5_1": 2}.get(qtype, 1)
        halves = np.concatenate([rng.normal(0, 1, 30) * 10.0 ** rng.integers(-7, 4, 30), [0, -0.0, 6e-8, -65504]])
        scales = rng.choice(halves, (7, 9, heads)).astype(np.float16).view(np.uint8).reshape(7, 9, 2 * heads)
        raw.reshape(7, 9, block_bytes)[..., :2 * heads] = scales
    else:  # whole floats: draw finite ones
        dtype = {"F16": np.float16, "F32": np.float32}[qtype]
        values = rng.normal(0, 1, 7 * 9 * block_bytes // np.dtype(dtype).itemsize).astype(dtype)
        raw = values.view(np.uint8).reshape(7, -1)
    ours = gguf_quants.dequantize(raw, Q[qtype])
    expected = gguf.quants.dequantize(raw, Q[qtype]).reshape(7, -1)
    assert ours.dtype == torch.float32 and ours.shape == (7, 9 * size)
    assert np.array_equal(ours.numpy().view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_the_tests_k_quantizer_packs_each_field_where_gguf_reads_it(qtype):
    """gguf has no K-quant quantizer, so tests/gguf_files.py has a plain one; its blocks de-quantize to
    within the type's resolution (a field packed in the wrong place would be off by the values' size)."""
    x = np.random.default_rng(0).normal(0, 0.1, (6, 512)).astype(np.float32)
    back = gguf.quants.dequantize(k_quantize(x, qtype), qtype).reshape(x.shape)
    bits = int(qtype.name[1])
    assert np.sqrt(np.mean((back - x) ** 2)) < 2 * 2.0**-bits * x.std()


def test_unpermute_order_inverts_llama_cpps_permutation():
    rows = np.arange(4 * 16)
    assert (llama_cpp_permute(rows, 4)[unpermute_order(64, 4)] == rows).all()


def test_an_unsupported_tensor_type_is_named(tmp_path):
    path = tmp_path / "iq.gguf"
    bytes_per_row = COMMON["hidden_size"] // 32 * 18  # IQ4_NL: 32 weights in 18 bytes
    rows = np.random.default_rng(0).integers(0, 255, (COMMON["intermediate_size"], bytes_per_row), dtype=np.uint8)
    write_gguf(path, "llama", "F16", raw={"model.layers.1.mlp.up_proj.weight": (rows, Q.IQ4_NL)})
    with pytest.raises(UnsupportedModelError, match="IQ4_NL.*supported: F32, F16") as e:
        LLM(str(path), enforce_eager=True)
    assert "\n" not in str(e.value)


def test_a_truncated_or_corrupt_file_is_a_clear_error(tmp_path):
    path = tmp_path / "whole.gguf"
    write_gguf(path, "llama", "Q8_0")
    data = path.read_bytes()
    for name, content in (("truncated", data[:len(data) * 2 // 3]), ("header-only", data[:100]),
                          ("not-gguf", b"hello, world\n" * 10)):
        broken = tmp_path / f"{name}.gguf"
        broken.write_bytes(content)
        with pytest.raises(CheckpointError, match="not a readable GGUF file.*truncated or corrupt") as e:
            LLM(str(broken), enforce_eager=True)
        assert "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        LLM(str(tmp_path / "missing.gguf"))


def test_unknown_architectures_are_one_line_naming_the_supported_ones(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, "llama", "F32", arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture.*'gpt2'; supported: llama") as e:
        load_model_config(path)
    assert "\n" not in str(e.value)
    for name, fields in (("gpt2", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}),
                         ("future", {"architectures": ["FutureForCausalLM"], "model_type": "future_model"}),
                         ("no-architectures", {"model_type": "future_model"})):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**fields, "hidden_size": 64}))
        with pytest.raises(UnsupportedModelError, match="unsupported architecture.*the toolkit runs LlamaForCausalLM") as e:
            load_model_config(folder)
        assert "\n" not in str(e.value) and "transformers" not in str(e.value)


@pytest.fixture(scope="module")
def tiny_gguf_with_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    path = folder / "tiny.Q8_0.gguf"
    write_gguf(path, "llama", "Q8_0", seed=3, tokenizer=write_tokenizer(folder / "tokenizer"))
    return path


def test_the_tokenizer_and_chat_template_come_from_the_file(tiny_gguf_with_tokenizer):
    from transformers import AutoTokenizer

    llm = engine(tiny_gguf_with_tokenizer)
    folder = AutoTokenizer.from_pretrained(tiny_gguf_with_tokenizer.parent / "tokenizer")
    text = "the cat sat on the mat"
    assert llm.get_tokenizer().encode(text) == folder.encode(text)
    messages = [{"role": "user", "content": "hello world"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt_token_ids == folder.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    # A tokenizer= folder replaces the file's.
    assert engine(tiny_gguf_with_tokenizer, tokenizer=str(tiny_gguf_with_tokenizer.parent / "tokenizer")
                  ).get_tokenizer().encode(text) == folder.encode(text)


def test_cli_generate_and_info_take_a_gguf_file(tiny_gguf_with_tokenizer):
    run = CliRunner().invoke(app, ["generate", "-m", str(tiny_gguf_with_tokenizer), "--eager", "--dtype", "float32",
                                   "--max-model-len", "128", "--max-tokens", "4", "--temperature", "0",
                                   "the cat sat"], catch_exceptions=False)
    assert run.exit_code == 0, run.output
    assert run.stdout.strip()
    info = CliRunner().invoke(app, ["info", str(tiny_gguf_with_tokenizer), "--json", "--memory", "1GiB"],
                              catch_exceptions=False)
    assert info.exit_code == 0, info.output
    report = json.loads(info.stdout)
    layers, matrices = COMMON["num_hidden_layers"], 7
    assert report["checkpoint_tensors_per_dtype"] == {"F32": 2 * layers + 1, "Q8_0": matrices * layers + 2}
    assert report["num_parameters"] == report["checkpoint_parameters"]
    assert report["kv_bytes_per_token"] == 2 * layers * COMMON["num_key_value_heads"] * 16 * 4
    text = CliRunner().invoke(app, ["info", str(tiny_gguf_with_tokenizer), "--memory", "1GiB"]).stdout
    assert f"{2 * layers + 1} F32, {matrices * layers + 2} Q8_0 tensors" in text


def test_the_cli_parses_a_files_tokenizer_once_and_each_caller_owns_its_copy(tmp_path, monkeypatch):
    """toolkit generate needs the tokenizer before loading (to measure its input) and in the engine:
    one parse per file version (seconds for a real vocabulary), a copy each."""
    from transformers import AutoTokenizer

    from toolkit.gguf_checkpoint import load_tokenizer

    path = tmp_path / "tok.Q8_0.gguf"
    write_gguf(path, "llama", "Q8_0", seed=3, tokenizer=write_tokenizer(tmp_path / "tokenizer"))
    parses = []
    parse = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: parses.append(k) or parse(*a, **k))
    run = CliRunner().invoke(app, ["generate", "-m", str(path), "--eager", "--dtype", "float32", "--max-model-len", "128",
                                   "--max-tokens", "4", "--temperature", "0", "the cat sat"], catch_exceptions=False)
    assert run.exit_code == 0, run.output
    assert [k.get("gguf_file") for k in parses] == [path.name]
    first, second = load_tokenizer(path), load_tokenizer(path)
    assert first is not second and first.encode("the cat") == second.encode("the cat")
    first.chat_template = "changed"
    assert load_tokenizer(path).chat_template == second.chat_template != "changed"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new version of the file: parsed again
    load_tokenizer(path)
    assert len(parses) == 2


def test_a_files_tokenizer_is_saved_once_and_the_saved_one_tokenizes_alike(tmp_path, monkeypatch):
    """A warm start reads the tokenizer transformers saved under TOOLKIT_CACHE instead of the file's
    vocabulary: the same ids, text, special tokens and chat template as the one built from the file."""
    from toolkit import gguf_checkpoint
    from toolkit.gguf_checkpoint import _tokenizer, load_tokenizer

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_checkpoint, "SAVE_MIN_TOKENS", 0)  # as a real vocabulary is
    path = tmp_path / "tok.Q8_0.gguf"
    write_gguf(path, "llama", "Q8_0", seed=3, tokenizer=write_tokenizer(tmp_path / "tokenizer"))
    _tokenizer.cache_clear()
    built = load_tokenizer(path)
    saved = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert len(saved) == 1 and (saved[0] / "tokenizer.json").is_file()
    _tokenizer.cache_clear()  # as a new process would
    reloaded = load_tokenizer(path)
    assert reloaded.name_or_path == str(saved[0])
    for text in ("the cat sat on the mat", "  Héllo\nwörld 42 ", "<|im_start|>user"):
        assert reloaded.encode(text) == built.encode(text), text
        assert reloaded.decode(built.encode(text)) == built.decode(built.encode(text)), text
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    assert (reloaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == built.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    assert (reloaded.eos_token_id, reloaded.bos_token_id, len(reloaded)) == (built.eos_token_id, built.bos_token_id,
                                                                            len(built))
    _tokenizer.cache_clear()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_files_tokenizer_is_transformers_own_without_gguf_reading_the_files_vocabulary(tmp_path, monkeypatch,
                                                                                         family):
    """The tokenizer built from a file equals AutoTokenizer's for that file (its class, settings, ids and
    chat template), though transformers' read of the model config (gguf's reader, which walks every
    array of the file element by element) went to a copy of the file's scalar metadata."""
    from transformers import AutoTokenizer

    from toolkit.gguf_checkpoint import _tokenizer, read

    path = tmp_path / f"{family}.Q8_0.gguf"
    write_gguf(path, family, "Q8_0", seed=3, tokenizer=write_tokenizer(tmp_path / "tokenizer"))
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    read(path)  # the toolkit's own index of the file, which load_tokenizer reads first (has_tokenizer)
    opened = []
    init = gguf.GGUFReader.__init__
    monkeypatch.setattr(gguf.GGUFReader, "__init__", lambda self, file, *a, **k: opened.append(str(file)) or
                        init(self, file, *a, **k))
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    _tokenizer.cache_clear()
    stat = path.stat()
    built = _tokenizer(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    assert opened and str(path) not in opened and str(path.resolve()) not in opened, opened
    assert type(built) is type(reference) and built.init_kwargs == reference.init_kwargs
    for text in ("the cat sat on the mat", "  Héllo\nwörld 42 ", "<|im_start|>user"):
        assert built.encode(text) == reference.encode(text), text
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    assert (built.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    _tokenizer.cache_clear()


def test_a_files_index_is_saved_and_read_back_as_gguf_reads_the_file(tmp_path, monkeypatch):
    """Later starts read the file's metadata and tensor places from the index under TOOLKIT_CACHE:
    the same values and bytes as gguf's own reader; a damaged index is parsed again."""
    import numpy as np
    from gguf import GGUFReader

    from toolkit import gguf_checkpoint
    from toolkit.gguf_checkpoint import _read, read

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_checkpoint, "SAVE_MIN_TOKENS", 0)  # as a real vocabulary is
    path = tmp_path / "m.Q8_0.gguf"
    write_gguf(path, "llama", "Q8_0", seed=3, tokenizer=write_tokenizer(tmp_path / "tokenizer"))
    _read.cache_clear()
    read(path)
    saved = list((tmp_path / "cache" / "gguf").iterdir())
    assert len(saved) == 1
    reader = GGUFReader(path)
    for damage in (None, "{", '{"fields": {}}'):
        if damage is not None:
            saved[0].write_text(damage)
        _read.cache_clear()  # as a new process would
        index = read(path)
        assert {k: f.contents() for k, f in index.fields.items()} == {k: f.contents() for k, f in reader.fields.items()}
        assert len(index.tensors) == len(reader.tensors) > 0
        for got, want in zip(index.tensors, reader.tensors):
            assert (got.name, got.tensor_type, got.shape.tolist(), got.n_bytes) == (
                want.name, int(want.tensor_type), want.shape.tolist(), want.n_bytes)
            assert np.array_equal(np.asarray(got.data), np.asarray(want.data).view(np.uint8).reshape(-1))
    _read.cache_clear()


def test_a_file_without_a_vocabulary_runs_token_ids_and_refuses_text_in_one_line(tmp_path):
    path = tmp_path / "weights-only.Q8_0.gguf"
    write_gguf(path, "llama", "Q8_0", seed=3)  # no tokenizer metadata: the weights alone
    llm = engine(path)  # no skip_tokenizer_init needed
    assert llm.get_tokenizer() is None
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["the cat"], SamplingParams(max_tokens=3), use_tqdm=False)
