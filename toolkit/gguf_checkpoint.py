"""GGUF checkpoints (llama.cpp's one-file format): the config, tokenizer and tensors of a `.gguf` file.

A GGUF file holds the model's hyperparameters as metadata (`llama.block_count`, ...), the tokenizer
with its chat template, and every tensor under llama.cpp's names (`blk.0.attn_q.weight`), most of
them quantized in blocks along each row. This module turns the metadata into the transformers
config that `toolkit.config.load_model_config` reads for any checkpoint, and offers the tensors
under Hugging Face names as lazy slices, de-quantized (to float32) only when read, so
`weights.load_weights` fills a model from a GGUF file exactly as from safetensors: a tensor-parallel
rank de-quantizes only its own rows, and only its own columns where they start and end on a
quantization block; a pipeline stage skips the other stages' tensors unread.

llama.cpp's converter permutes the rows of Llama's q and k projections (it interleaves the two
rotary halves of each head for its own RoPE kernel); reading those rows in the inverse order gives
back the Hugging Face layout the model code expects.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import struct
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from toolkit import gguf_quants
from toolkit.config import UnsupportedModelError
from toolkit.weights import CheckpointError

SUFFIX = ".gguf"

# general.architecture -> the architecture the toolkit runs it as. Only llama's q/k rows are permuted
# by llama.cpp's converter (the Qwen families use its NeoX RoPE, which needs no permutation).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED_QK = ("llama",)
# Tensor types de-quantized at load (toolkit/gguf_quants.py: torch for Q4_0, Q4_1 and Q8_0, gguf.quants
# for the rest), each checked against transformers by the tests. The
# K-quants' blocks hold 256 values (the others' 32): a TP rank reads only its columns' bytes where its
# range starts and ends on 256, and whole rows, cut, where it does not.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# llama.cpp's tensor names -> Hugging Face's, per layer (blk.N.x -> model.layers.N.y) and global.
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
GLOBAL_TENSOR = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def is_gguf(path) -> bool:
    return Path(path).suffix.lower() == SUFFIX


def hf_name(name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor name; a name this table lacks is kept, so the loader
    refuses it as a tensor the model does not have."""
    m = LAYER_TENSOR.match(name)
    if m is not None and m[2] in LAYER_NAMES:
        return f"model.layers.{m[1]}.{LAYER_NAMES[m[2]]}.{m[3]}"
    m = GLOBAL_TENSOR.match(name)
    if m is not None and m[1] in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[m[1]]}.{m[2]}"
    return name


def read(path) -> "GGUFIndex":
    """What the toolkit reads of the file (its metadata, and where each tensor's bytes are), once per
    file version: parsed by gguf's reader the first time and kept as an index under
    TOOLKIT_CACHE/gguf, since the parse walks the vocabulary element by element (seconds for a real
    model, at every start)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    stat = path.stat()
    return _read(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@dataclass
class IndexedField:
    value: object

    def contents(self):
        return self.value


@dataclass
class IndexedTensor:
    """A tensor's record (gguf's ReaderTensor's fields the loader uses); its bytes are mapped on use."""

    path: str
    name: str
    tensor_type: int
    shape: np.ndarray  # innermost dimension first, as GGUF lists them
    n_bytes: int
    data_offset: int

    @functools.cached_property
    def data(self) -> np.ndarray:
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_offset, shape=(self.n_bytes,))


@dataclass
class GGUFIndex:
    fields: dict[str, IndexedField]
    tensors: list[IndexedTensor]


INDEX_VERSION = 1
# A file whose vocabulary is smaller parses (and builds its tokenizer) in milliseconds: nothing is saved
# for it, so test and toy files leave nothing behind in the cache.
SAVE_MIN_TOKENS = 4096


@functools.lru_cache(maxsize=2)
def _read(path: str, mtime_ns: int, size: int) -> GGUFIndex:
    import hashlib

    from toolkit import envs

    key = hashlib.sha256(f"{INDEX_VERSION}\0{path}\0{mtime_ns}\0{size}".encode()).hexdigest()[:24]
    saved = envs.cache_root() / "gguf" / f"{key}.json"
    try:
        return _index(path, json.loads(saved.read_text()))
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or damaged: parse the file
        doc = _parse(path)
        if len(doc["fields"].get("tokenizer.ggml.tokens") or ()) >= SAVE_MIN_TOKENS:
            _save(saved, doc)
        return _index(path, doc)


def _index(path: str, doc: dict) -> GGUFIndex:
    return GGUFIndex({k: IndexedField(v) for k, v in doc["fields"].items()},
                     [IndexedTensor(path, t["name"], t["type"], np.array(t["shape"], dtype=np.uint64), t["n_bytes"],
                                    t["offset"]) for t in doc["tensors"]])


def _parse(path: str) -> dict:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, EOFError, struct.error, OSError) as e:
        raise CheckpointError(f"{path} is not a readable GGUF file ({e}): it may be truncated or corrupt; "
                              "download or convert it again") from None
    fields = {}
    for key, field in reader.fields.items():
        try:
            fields[key] = field.contents()
        except (ValueError, UnicodeDecodeError):  # a value gguf cannot decode: nothing the toolkit reads
            pass
    return {"fields": fields,
            "tensors": [{"name": t.name, "type": int(t.tensor_type), "shape": [int(n) for n in t.shape],
                         "n_bytes": int(t.n_bytes), "offset": int(t.data_offset)} for t in reader.tensors]}


def _save(saved: Path, doc: dict) -> None:
    import os

    try:  # written aside, then renamed: a concurrent process never reads half a file
        saved.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=saved.parent, suffix=".tmp", delete=False) as f:
            json.dump(doc, f, default=lambda v: v.item() if isinstance(v, np.generic) else str(v))
        os.replace(f.name, saved)
    except OSError:  # a read-only or full cache: the next start parses again
        pass


def metadata(reader, key: str, default=...):
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise CheckpointError(f"GGUF metadata lacks {key!r}: not a complete model file")
        return default
    return field.contents()


def hf_config(path):
    """A transformers config holding what the file's metadata says: what `load_model_config` reads
    from a config.json. A plain PretrainedConfig, not the family's class: importing LlamaConfig or
    Qwen2Config pulls transformers' modeling and DTensor modules into every start, and the toolkit
    reads only the fields set here. Unsupported architectures, tensor types and options are refused
    here, before anything loads."""
    from transformers import PretrainedConfig

    reader = read(path)
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported GGUF architecture in {path}: {arch!r}; supported: "
                                    f"{', '.join(ARCHITECTURES)}")
    _check_tensor_types(reader, path)
    names = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(f"{path}: per-frequency RoPE factors (rope_freqs, Llama 3.1-style scaling) "
                                    "are not implemented for GGUF files")
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{path} has no token_embd.weight tensor: not a complete model file")
    heads = _count(metadata(reader, f"{arch}.attention.head_count"), f"{arch}.attention.head_count", path)
    hidden = int(metadata(reader, f"{arch}.embedding_length"))
    head_dim = int(metadata(reader, f"{arch}.attention.key_length", hidden // heads))
    rotary = metadata(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise UnsupportedModelError(f"{path}: RoPE on {rotary} of {head_dim} head dimensions is not implemented")
    config = PretrainedConfig(
        architectures=[ARCHITECTURES[arch]],
        vocab_size=int(names["token_embd.weight"].shape[-1]),
        hidden_size=hidden,
        intermediate_size=int(metadata(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(metadata(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=_count(metadata(reader, f"{arch}.attention.head_count_kv", heads),
                                   f"{arch}.attention.head_count_kv", path),
        head_dim=head_dim,
        rms_norm_eps=float(metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(metadata(reader, f"{arch}.context_length")),
        rope_parameters=_rope(reader, arch, path),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        mlp_bias="blk.0.ffn_gate.bias" in names,
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=metadata(reader, "tokenizer.ggml.eos_token_id", None),
        pad_token_id=metadata(reader, "tokenizer.ggml.padding_token_id", None),
        hidden_act="silu",  # what llama.cpp runs for all three architectures
        # De-quantized weights are exact in float32 (f16 and bf16 ones too); dtype= chooses another.
        dtype="float32",
    )
    return config


def _count(value, key: str, path) -> int:
    if not isinstance(value, (int, np.integer)):  # llama.cpp writes an array when layers differ
        raise UnsupportedModelError(f"{path}: {key} differs per layer ({value!r}), which is not implemented")
    return int(value)


def _rope(reader, arch: str, path) -> dict:
    theta = float(metadata(reader, f"{arch}.rope.freq_base", 10000.0))
    kind = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta,
                "factor": float(metadata(reader, f"{arch}.rope.scaling.factor"))}
    raise UnsupportedModelError(f"{path}: RoPE scaling {kind!r} is not implemented for GGUF files "
                                "(none and linear are)")


def _check_tensor_types(reader, path) -> None:
    from gguf import GGMLQuantizationType

    other = sorted({GGMLQuantizationType(t.tensor_type).name for t in reader.tensors} - set(SUPPORTED_TYPES))
    if other:
        raise UnsupportedModelError(f"{path} holds tensors of type {', '.join(other)}, which the toolkit does not "
                                    f"de-quantize; supported: {', '.join(SUPPORTED_TYPES)}")


def tensor_types(path) -> dict[str, int]:
    """How many tensors of each type (F32, Q4_1, ...) the file holds."""
    from gguf import GGMLQuantizationType

    counts: dict[str, int] = {}
    for t in read(path).tensors:
        name = GGMLQuantizationType(t.tensor_type).name
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def has_tokenizer(path) -> bool:
    """Whether the file stores a vocabulary (a GGUF may hold the weights alone)."""
    return "tokenizer.ggml.tokens" in read(path).fields


def load_tokenizer(path, own_copy: bool = True):
    """The tokenizer and chat template stored in the file (transformers builds a fast tokenizer from
    them). Built once per file version, since that takes seconds for a real vocabulary and the CLI
    asks twice (to measure its input, then in the engine); each caller gets its own copy to change,
    unless it asks for none (`own_copy=False`: it only tokenizes)."""
    path = Path(path)
    stat = path.stat()
    tokenizer = _tokenizer(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    return copy.deepcopy(tokenizer) if own_copy else tokenizer


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str, mtime_ns: int, size: int):
    """Built from the file once per file version and kept, as saved by transformers, under
    TOOLKIT_CACHE/tokenizers: reading the vocabulary out of GGUF metadata is most of a warm start."""
    import hashlib
    import os

    from transformers import AutoTokenizer

    from toolkit import envs

    key = hashlib.sha256(f"{path}\0{mtime_ns}\0{size}".encode()).hexdigest()[:24]
    saved = envs.cache_root() / "tokenizers" / key
    if (saved / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(saved)
    with _model_config_from_metadata(path):
        tokenizer = AutoTokenizer.from_pretrained(Path(path).parent, gguf_file=Path(path).name)
    if len(tokenizer) < SAVE_MIN_TOKENS:
        return tokenizer
    try:  # written aside, then renamed: a concurrent process never reads half a folder
        saved.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=saved.parent) as tmp:
            tokenizer.save_pretrained(tmp)
            os.rename(tmp, saved)
            os.mkdir(tmp)  # for TemporaryDirectory's own cleanup
    except OSError:  # a read-only or full cache, or another process saved it first: this run does without
        pass
    return tokenizer


@contextmanager
def _model_config_from_metadata(path: str):
    """While AutoTokenizer builds a GGUF file's tokenizer, the model config it reads to choose the
    tokenizer's class comes from a copy of the file's scalar metadata. transformers reads that config
    with gguf's own reader, which walks every metadata array element by element, the vocabulary and
    merges among them (seconds for a real vocabulary), to learn the model type; it reads the tokenizer
    itself from the file with a fast reader of its own. Its own code still makes every choice."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        original = gguf_utils.load_gguf_checkpoint
    except (ImportError, AttributeError):  # another transformers layout: its own, slower path
        original = None
    if original is None:
        yield
        return
    target = Path(path).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        stub = Path(tmp) / "metadata.gguf"
        _write_scalar_metadata(path, stub)

        def load(file, return_tensors=False, **kwargs):
            if not return_tensors and Path(file).resolve() == target:
                return original(str(stub), return_tensors=False, **kwargs)
            return original(file, return_tensors=return_tensors, **kwargs)

        gguf_utils.load_gguf_checkpoint = load
        try:
            yield
        finally:
            gguf_utils.load_gguf_checkpoint = original


def _write_scalar_metadata(path, out: Path) -> None:
    """A GGUF file at `out` with `path`'s scalar metadata but no tokenizer fields, no arrays and no
    tensors; the vocabulary's size is kept as `{arch}.vocab_size`, which a config would take from it."""
    import gguf

    reader = read(path)
    arch = metadata(reader, "general.architecture")
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        value = field.contents()
        if key.startswith(("GGUF.", "tokenizer.")) or key == "general.architecture" or \
                isinstance(value, (list, tuple, np.ndarray)):
            continue
        writer.add_key_value(key, value, _value_type(value))
    tokens = metadata(reader, "tokenizer.ggml.tokens", None)
    if f"{arch}.vocab_size" not in reader.fields and tokens is not None:
        writer.add_uint32(f"{arch}.vocab_size", len(tokens))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _value_type(value):
    from gguf import GGUFValueType

    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, (int, np.integer)):
        return GGUFValueType.INT64 if value < 0 else GGUFValueType.UINT64
    if isinstance(value, (float, np.floating)):
        return GGUFValueType.FLOAT32
    return GGUFValueType.STRING


class GGUFTensors:
    """A GGUF file's tensors under Hugging Face names: `keys()` and `get_slice(name)`, the part of a
    safetensors file's interface `weights.load_weights` uses."""

    def __init__(self, path):
        reader = read(path)
        arch = metadata(reader, "general.architecture")
        heads = metadata(reader, f"{arch}.attention.head_count", None)
        kv_heads = metadata(reader, f"{arch}.attention.head_count_kv", heads)
        self.slices: dict[str, GGUFSlice] = {}
        for tensor in reader.tensors:
            name = hf_name(tensor.name)
            order = None
            if arch in PERMUTED_QK and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                order = unpermute_order(int(tensor.shape[-1]), heads)
            elif arch in PERMUTED_QK and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                order = unpermute_order(int(tensor.shape[-1]), kv_heads)
            self.slices[name] = GGUFSlice(tensor, order)

    def keys(self):
        return list(self.slices)

    def get_slice(self, name: str) -> "GGUFSlice":
        return self.slices[name]


def unpermute_order(rows: int, num_heads: int) -> np.ndarray:
    """For each Hugging Face row of a q or k projection, the row llama.cpp stored it at: within each
    head, HF keeps the first rotary half then the second; llama.cpp interleaves them (row 2i is HF's
    row i, row 2i + 1 is HF's row i + head_dim / 2)."""
    half = rows // num_heads // 2
    return np.arange(rows).reshape(num_heads, half, 2).transpose(0, 2, 1).reshape(-1)


class GGUFSlice:
    """One tensor, read and de-quantized when indexed (safetensors' slice interface: `get_shape()`,
    `get_dtype()`, `[index]`). Quantization blocks run along each row, so rows are read alone, and
    columns alone where the wanted range starts and ends on a block."""

    def __init__(self, tensor, row_order: np.ndarray | None = None):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.tensor = tensor
        self.qtype = GGMLQuantizationType(tensor.tensor_type)
        self.block, self.block_bytes = GGML_QUANT_SIZES[self.qtype]
        self.shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists dimensions innermost first
        self.row_order = row_order

    @property
    def nbytes(self) -> int:
        """Bytes as stored (quantized)."""
        return int(self.tensor.n_bytes)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.qtype.name

    def __getitem__(self, index) -> torch.Tensor:
        """`index`: a slice or a tuple of slices (what the loader and tensor-parallel plans pass)."""
        index = index if isinstance(index, tuple) else (index,)
        if len(self.shape) == 1:
            values = self._dequantize(self._bytes_per_row()).reshape(-1)
            return (values if self.row_order is None else values[torch.from_numpy(self.row_order)])[index]
        rows = np.arange(self.shape[0])[index[0] if index else slice(None)]
        if self.row_order is not None:
            rows = self.row_order[rows]
        cols = index[1] if len(index) > 1 else slice(None)
        start, stop, step = cols.indices(self.shape[1])
        data = self._bytes_per_row()
        if step == 1 and start % self.block == 0 and (stop % self.block == 0 or stop == self.shape[1]):
            # Whole blocks: read only those bytes of each row.
            first, end = start // self.block * self.block_bytes, -(-stop // self.block) * self.block_bytes
            return self._dequantize(data[rows, first:end])[:, :stop - start].contiguous()
        return self._dequantize(data[rows])[:, cols].contiguous()

    def _bytes_per_row(self) -> np.ndarray:
        return np.asarray(self.tensor.data).view(np.uint8).reshape(self.shape[0] if len(self.shape) > 1 else 1, -1)

    def _dequantize(self, raw: np.ndarray) -> torch.Tensor:
        return gguf_quants.dequantize(raw, self.qtype)
