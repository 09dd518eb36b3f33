"""GGUF files for tests, written as llama.cpp's converter writes them, and transformers oracles on
their de-quantized weights.

`write_gguf` writes a small seeded random model with the `gguf` package's writer: llama.cpp's tensor
names, 1-D tensors in F32, every matrix in the case's type, and for the llama architecture the q/k
rows permuted. It returns a transformers model holding the same weights, de-quantized here with
`gguf.quants.dequantize` before any permutation, so the oracle never runs the loader's
un-permutation. `dequantized_model` builds the same oracle for an existing file (the real SmolLM2
one): transformers' reading of the metadata, the tensors de-quantized and un-permuted here, whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from tests.checkpoints import CHAT_TEMPLATE, COMMON
from tests.checkpoints import model_greedy as hf_greedy  # noqa: F401  (transformers greedy on a model built here)

LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# (GGUF architecture, transformers config and model classes, config changes)
FAMILIES = {
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", {}),
    "llama_tied_mqa": ("llama", "LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True,
                                                                        num_key_value_heads=1)),
    "qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
}

# A K-quant block holds 256 values along a row: matrices need rows of a multiple of 256 (o_proj,
# gate/up and the embedding take hidden_size, down_proj intermediate_size).
K_DIMS = dict(hidden_size=256, intermediate_size=512)
# A file mixing types as llama.cpp's Q4_K_M does: write_gguf's `mix` over a Q4_K base.
Q4_K_M = {"v_proj": "Q6_K", "down_proj": "Q6_K", "embed_tokens": "Q8_0"}


def gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base in GLOBAL:
        return f"{GLOBAL[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{LAYER[rest]}.{kind}"


def llama_cpp_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of q/k rows (rows may be quantized bytes)."""
    return rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def quantize(tensor: torch.Tensor, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, in HF row order; its de-quantized float32 values)."""
    values = tensor.float().numpy()
    stored = k_quantize(values, qtype) if qtype in K_QUANTS else gguf.quants.quantize(values, qtype)
    return stored, gguf.quants.dequantize(stored, qtype).reshape(tensor.shape).astype(np.float32)


def write_gguf(path: Path, family: str, qtype: str, seed: int = 0, tokenizer: Path | None = None, arch=None,
               raw: dict | None = None, mix: dict[str, str] | None = None, **overrides):
    """Writes the case's GGUF file; returns the transformers model holding its de-quantized weights.
    `raw` replaces named tensors by (bytes, type) as stored; `mix` gives the matrices whose name holds
    a key that key's type instead of `qtype`; `arch` overrides general.architecture; `overrides`
    change the config."""
    import transformers

    gguf_arch, config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    writer = gguf.GGUFWriter(path, arch or gguf_arch)
    add_metadata(writer, config)
    if tokenizer is not None:
        add_tokenizer(writer, tokenizer, config.vocab_size)
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        matrix_type = next((t for part, t in (mix or {}).items() if part in name), qtype)
        kind = Q[matrix_type] if tensor.dim() == 2 else Q.F32  # llama.cpp keeps norms (and biases) in F32
        stored, values = quantize(tensor, kind)
        state[name] = torch.from_numpy(values)
        if raw is not None and name in raw:
            stored, kind = raw[name]
        if gguf_arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            stored = llama_cpp_permute(stored, heads)
        writer.add_tensor(gguf_name(name), stored, raw_dtype=kind if stored.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


def add_metadata(writer, config) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)


def add_tokenizer(writer, folder: Path, vocab_size: int) -> None:
    """The tests' byte-level BPE tokenizer as llama.cpp stores a gpt2-style one."""
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    specials = {t["content"] for t in data["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_chat_template(CHAT_TEMPLATE)


def dequantized_model(path: Path):
    """A transformers Llama holding an existing file's weights: its config as transformers reads the
    metadata, the tensors de-quantized whole and their q/k rows un-permuted here (not by the loader)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = LlamaConfig(**load_gguf_checkpoint(path, return_tensors=False)["config"])
    names = {v: k for k, v in GLOBAL.items()} | {v: k for k, v in LAYER.items()}
    state = {}
    for t in gguf.GGUFReader(path).tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        base, kind = t.name.rsplit(".", 1)
        if base.startswith("blk."):
            _, layer, part = base.split(".", 2)
            if part in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if part == "attn_q" else config.num_key_value_heads
                values = values.reshape(heads, values.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(values.shape)
            name = f"model.layers.{layer}.{names[part]}.{kind}"
        else:
            name = f"{names[base]}.{kind}"
        state[name] = torch.from_numpy(np.require(values, np.float32, ["C", "W"]))
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(state, strict=True)
    return model


# --- K-quants: the gguf package de-quantizes them but has no quantizer; this plain one (per sub-block
# min/max or absmax, no search) only has to give valid blocks close to the weights it is given.

QK_K = 256
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def k_quantize(x: np.ndarray, qtype: Q) -> np.ndarray:
    """Q2_K..Q6_K blocks (uint8 rows, 256 values per block) holding `x`'s rows."""
    rows = x.reshape(-1, QK_K).astype(np.float32)
    blocks = {Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}[qtype](rows)
    return blocks.reshape(*x.shape[:-1], -1)


def _f16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the f16 bytes, the f32 value they hold) of per-block scales; zero scales become 1 (unused)."""
    half = np.where(values > 0, values, 1).astype(np.float16)
    return half.reshape(-1, 1).view(np.uint8), half.astype(np.float32).reshape(-1, 1)


def _min_scale(rows: np.ndarray, sub: int, levels: int, scale_bits: int):
    """Unsigned quantization with a per-sub-block scale and min, both quantized against the block's
    (d, dmin): returns (q, sc, m, d bytes, dmin bytes)."""
    x = rows.reshape(len(rows), -1, sub)
    lo = np.minimum(x.min(-1), 0)
    scale, mn = (x.max(-1) - lo) / levels, -lo
    top = 2**scale_bits - 1
    d_bytes, d = _f16(scale.max(-1) / top)
    dmin_bytes, dmin = _f16(mn.max(-1) / top)
    sc = np.clip(np.rint(scale / d), 1, top)
    m = np.clip(np.rint(mn / dmin), 0, top)
    q = np.clip(np.rint((x + (dmin * m)[..., None]) / (d * sc)[..., None]), 0, levels)
    return q.astype(np.uint8).reshape(len(rows), -1), sc.astype(np.uint8), m.astype(np.uint8), d_bytes, dmin_bytes


def _abs_scale(rows: np.ndarray, sub: int, low: int, high: int, scale_low: int, scale_high: int):
    """Signed quantization to [low, high] with a signed per-sub-block scale quantized against the
    block's d: returns (q, sc, d bytes)."""
    x = rows.reshape(len(rows), -1, sub)
    scale = np.abs(x).max(-1) / high
    d_bytes, d = _f16(scale.max(-1) / scale_high)
    sc = np.clip(np.rint(scale / d), 1, scale_high)
    q = np.clip(np.rint(x / (d * sc)[..., None]), low, high)
    return q.astype(np.int16).reshape(len(rows), -1), sc.astype(np.int16), d_bytes


def _two_bit_planes(values: np.ndarray, group: int) -> np.ndarray:
    """2-bit values packed four to a byte: value t*group + j of each 4*group run in bits 2t of byte j."""
    v = values.reshape(len(values), -1, 4, group)
    return (v[:, :, 0] | v[:, :, 1] << 2 | v[:, :, 2] << 4 | v[:, :, 3] << 6).reshape(len(values), -1)


def _nibbles(values: np.ndarray, group: int) -> np.ndarray:
    """4-bit values two to a byte: value j of each 2*group run low, value group + j high."""
    v = values.reshape(len(values), -1, 2, group)
    return (v[:, :, 0] | v[:, :, 1] << 4).reshape(len(values), -1)


def _bits(values: np.ndarray, width: int) -> np.ndarray:
    """1-bit planes: bit i of byte j holds value i*width + j."""
    v = values.reshape(len(values), -1, width)
    return sum(v[:, i] << i for i in range(v.shape[1])).astype(np.uint8)


def _packed_scales_6bit(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and mins (Q4_K.get_scale_min read backwards)."""
    return np.concatenate([sc[:, :4] & 0x3F | (sc[:, 4:] >> 4) << 6, m[:, :4] & 0x3F | (m[:, 4:] >> 4) << 6,
                           sc[:, 4:] & 0x0F | (m[:, 4:] & 0x0F) << 4], axis=1).astype(np.uint8)


def _q2_k(rows):
    q, sc, m, d, dmin = _min_scale(rows, 16, 3, 4)
    return np.concatenate([sc | m << 4, _two_bit_planes(q, 32), d, dmin], axis=1)


def _q3_k(rows):
    q, sc, d = _abs_scale(rows, 16, -4, 3, -32, 31)
    u, s = (q + 4).astype(np.uint8), (sc + 32).astype(np.uint8)
    low = s[:, :8] & 0x0F | (s[:, 8:] & 0x0F) << 4
    high = _two_bit_planes(s >> 4, 4)
    return np.concatenate([_bits(u >> 2, 32), _two_bit_planes(u & 3, 32), low, high, d], axis=1)


def _q4_k(rows):
    q, sc, m, d, dmin = _min_scale(rows, 32, 15, 6)
    return np.concatenate([d, dmin, _packed_scales_6bit(sc, m), _nibbles(q, 32)], axis=1)


def _q5_k(rows):
    q, sc, m, d, dmin = _min_scale(rows, 32, 31, 6)
    return np.concatenate([d, dmin, _packed_scales_6bit(sc, m), _bits(q >> 4, 32), _nibbles(q & 0x0F, 32)], axis=1)


def _q6_k(rows):
    q, sc, d = _abs_scale(rows, 16, -32, 31, -128, 127)
    u = (q + 32).astype(np.uint8)
    return np.concatenate([_nibbles(u & 0x0F, 64), _two_bit_planes(u >> 4, 32), sc.astype(np.int8).view(np.uint8), d],
                          axis=1)
