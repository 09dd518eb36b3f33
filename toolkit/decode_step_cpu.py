"""Decode-only steps on CPU: the whole model as one call into C++ (`decode_step_cpu.cpp`).

Why: a batch-1 decode step on this 2-core host spent ~40% of its time between kernels, in Python:
each layer's compiled-graph wrapper, four linear ops and the attention op with their checks and
allocations, ~0.4-0.6 ms a layer against ~0.55 ms of weight reads. Here the same panel-linear and
decode-attention kernels run back to back from C++, and Python is entered once per step. Python
between kernels is slow twice over: each weight stream evicts its code and data from the caches.
One call per layer still cost ~40 us a layer that way, and the lm_head op ~0.35 ms more than its
kernel, so the call covers the model from token ids to logits.

Applied from outside, like a parallel plan: `DecodeStep.install` wraps the model's forward so
decode-only steps take the C++ path, and every other step (prefill chunks, mixed batches) the
forward it had, with its compiled or eager layers. The model code is unchanged and stays the
reference. The C++ path is the dense family of toolkit/models/llama.py (Llama, Mistral, Qwen2
biases, Qwen3 q/k norms) over merged q/k/v and gate/up panel weights (toolkit/merged_linear.py,
linear_cpu.py); `unsupported` names what it does not take (other layer types, oneDNN weights, TP
shards), and those models keep their forward. Float32 results match the reference up to summation
order; in half types intermediates are rounded where the reference stores them (see the .cpp).

Built with the other kernels (attention/cpp_build.py). `TOOLKIT_CPU_DECODE_STEP=0` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import weakref
from pathlib import Path

import torch

from attention import cpp_build, decode_cpu
from toolkit import linear_cpu

SOURCE = Path(__file__).with_name("decode_step_cpu.cpp")
SWITCH = "TOOLKIT_CPU_DECODE_STEP"

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Layer(ctypes.Structure):  # decode_step_cpu.cpp's Layer
    _fields_ = [(name, _P) for name in ("input_norm", "post_norm", "q_norm", "k_norm", "qkv", "qkv_bias", "o",
                                        "o_bias", "gate_up", "gate_up_bias", "down", "down_bias")]


class _Model(ctypes.Structure):  # decode_step_cpu.cpp's Model
    _fields_ = [(name, _P) for name in ("layers", "kv_caches", "embedding", "cos", "sin", "final_norm", "lm_head")]


class _Shape(ctypes.Structure):  # decode_step_cpu.cpp's Shape
    _fields_ = [(name, _I64) for name in ("hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
                                          "block_size", "num_blocks", "num_layers", "vocab", "max_positions")] + \
               [("eps", _F32), ("qk_eps", _F32), ("scale", _F32), ("linear", _P), ("attention", _P)]


@functools.cache
def _library() -> ctypes.CDLL | None:
    signature = ([_P] * 7 + [_I64, _I64, _P, _I64, _P], _I64)
    return cpp_build.load(SOURCE, SWITCH, "CPU decode-step kernel", "the layer graphs for decode steps",
                          {f"decode_step_{suffix}": signature for suffix in linear_cpu.SUFFIX.values()})


def unsupported(model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> str | None:
    """Why the C++ path cannot run `model`'s decoder stack over `kv_caches`, or None where it can."""
    from toolkit.models import llama  # here: the model package imports the toolkit's linears

    decoder = getattr(model, "model", None)
    if (type(model) is not llama.LlamaForCausalLM or type(decoder) is not llama.DecoderModel
            or type(decoder.norm) is not llama.RMSNorm):
        return f"{type(model).__name__} is not the dense family's model"
    head = model.lm_head
    if (not isinstance(head, linear_cpu.PanelLinear) or head.bias is not None
            or head.panels.dtype != decoder.norm.weight.dtype or head.out_features != decoder.embed_tokens.num_embeddings):
        return "its lm_head is not a panel linear over the vocabulary, without bias, in the model dtype"
    if len(kv_caches) != len(decoder.layers):
        return f"{len(kv_caches)} KV caches for {len(decoder.layers)} layers"
    return next(filter(None, (_unsupported_layer(layer, cache) for layer, cache in zip(decoder.layers, kv_caches))),
                None)


def _unsupported_layer(layer, kv_cache) -> str | None:
    from toolkit.models import llama

    if not (type(layer) is llama.DecoderLayer and type(layer.self_attn) is llama.Attention
            and type(layer.mlp) is llama.MLP):
        return f"{type(layer).__name__} is not the dense family's decoder layer"
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.q_proj, attn.o_proj, mlp.gate_proj, mlp.down_proj)
    if not all(isinstance(lin, linear_cpu.PanelLinear) for lin in linears):
        return "its linears are not panel linears (toolkit/linear_cpu.py)"
    if len(getattr(attn.q_proj, "splits", ())) != 3 or len(getattr(mlp.gate_proj, "splits", ())) != 2:
        return "q/k/v and gate/up are not merged (toolkit/merged_linear.py)"
    dtype = layer.input_layernorm.weight.dtype
    if dtype not in linear_cpu.SUFFIX or any(lin.panels.dtype != dtype for lin in linears) or kv_cache.dtype != dtype:
        return f"weights, norms and KV cache are not all one of {list(linear_cpu.SUFFIX)}"
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        return "the KV cache is not one contiguous CPU tensor"
    q, k, v = attn.q_proj.splits
    d = attn.head_dim
    if q % d or k % d or k != v or (q // d) % (k // d) or tuple(kv_cache.shape[3:]) != (k // d, d):
        return f"q/k/v widths {q}/{k}/{v} do not fit head_dim {d} and the KV cache {tuple(kv_cache.shape)}"
    if d % 8 or kv_cache.shape[2] % 8 or not decode_cpu.kernel_available():
        return "the CPU decode-attention kernel does not take this head_dim or block size, or is unavailable"
    return None


class DecodeStep:
    """Runs decode-only steps of the model it is installed on through C++: token ids to logits."""

    def __init__(self, model, kv_caches: list[torch.Tensor], strict: bool = False):
        self.strict = strict  # a decode-only step it cannot take raises instead of running `forward`
        lib = _library()
        if lib is None:
            raise RuntimeError("the CPU decode-step kernel is unavailable (see the warning)")
        decoder, cache = model.model, kv_caches[0]
        first = decoder.layers[0]
        attn, mlp = first.self_attn, first.mlp
        self.dtype, self.cache_shape = cache.dtype, tuple(cache.shape)
        self.kv_caches, self._caches = kv_caches, tuple(kv_caches)  # the runner's list, and what it held
        self.kernel = getattr(lib, f"decode_step_{linear_cpu.SUFFIX[self.dtype]}")
        attention = getattr(decode_cpu._library(), decode_cpu.DTYPES[self.dtype])
        d, (q, k, _) = attn.head_dim, attn.q_proj.splits
        vocab, hidden = decoder.embed_tokens.weight.shape
        self.vocab = vocab
        rotary = decoder.rotary_emb
        self.shape = _Shape(hidden, q // d, k // d, d, mlp.gate_proj.splits[0], cache.shape[2], cache.shape[1],
                            len(decoder.layers), vocab, rotary.cos.shape[0], first.input_layernorm.eps,
                            attn.q_norm.eps if attn.qk_norm else 0.0, attn.scale,
                            ctypes.cast(linear_cpu._kernel(self.dtype), _P), ctypes.cast(attention, _P))
        # What the structs point into, held here. The rotary tables are float32 copies: the reference
        # rounds its tables to the model dtype each step, and the C++ does the same.
        cos, sin = rotary.cos.float().contiguous(), rotary.sin.float().contiguous()
        self._hold = [cos, sin]  # and the float32 biases, from _describe
        self._layers = (_Layer * len(decoder.layers))(*(self._describe(layer) for layer in decoder.layers))
        self._cache_pointers = (_P * len(kv_caches))(*(c.data_ptr() for c in kv_caches))
        self.model = _Model(ctypes.addressof(self._layers), ctypes.addressof(self._cache_pointers),
                            decoder.embed_tokens.weight.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                            decoder.norm.weight.data_ptr(), model.lm_head.panels.data_ptr())
        self._structs = (ctypes.byref(self.shape), ctypes.byref(self.model))

    def _describe(self, layer) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp

        def bias(linear):
            if linear.bias is None:
                return None
            self._hold.append(linear.bias.detach().float().contiguous())
            return self._hold[-1].data_ptr()

        norms = (attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()) if attn.qk_norm else (None, None)
        return _Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(), *norms,
                      attn.q_proj.panels.data_ptr(), bias(attn.q_proj), attn.o_proj.panels.data_ptr(), bias(attn.o_proj),
                      mlp.gate_proj.panels.data_ptr(), bias(mlp.gate_proj), mlp.down_proj.panels.data_ptr(),
                      bias(mlp.down_proj))

    def install(self, model) -> None:
        # As in toolkit/precompiled.py, the module holds only a module-level function, a number and the
        # forward it had: Dynamo pickles module attributes with the guards of the graphs it saves.
        index = next(_NUMBERS)
        _INSTALLED[index] = self
        model.forward = functools.partial(_run, index, model.forward)

    def __call__(self, forward, input_ids, positions, kv_caches, meta, logits_indices):
        if not meta.decode_only:
            return forward(input_ids, positions, kv_caches, meta, logits_indices)
        if not (kv_caches is self.kv_caches and self._takes(input_ids, positions, meta, logits_indices)):
            if self.strict:
                raise RuntimeError("decode step: a decode-only step that is not what the runner's prepare() builds "
                                   "(a bug: please report)")
            return forward(input_ids, positions, kv_caches, meta, logits_indices)
        return self.run_prepared(input_ids, positions, meta, logits_indices)

    def run_prepared(self, input_ids, positions, meta, logits_indices) -> torch.Tensor:
        """The step in C++ on tensors exactly as the runner's prepare() builds them: CPU, contiguous,
        int64 ids, positions, slots and logits indices, int32 lengths and tables, this step's caches.
        Those are not checked here (the runner calls this for the steps it built; any other caller
        goes through the installed forward, which checks); values out of range still raise."""
        rows, tables = input_ids.shape[0], meta.block_tables
        logits = torch.empty(logits_indices.shape[0], self.vocab)
        bad = self.kernel(*self._structs, input_ids.data_ptr(), positions.data_ptr(), meta.slot_mapping.data_ptr(),
                          meta.seq_lens.data_ptr(), tables.data_ptr(), tables.shape[1], rows,
                          logits_indices.data_ptr(), logits_indices.shape[0], logits.data_ptr())
        if bad:
            raise IndexError(self._error(bad, rows))
        return logits

    def _takes(self, input_ids, positions, meta, logits_indices) -> bool:
        """The tensors the runner's prepare() builds; anything else is left to the reference. (Spelled
        out, not looped: this runs once per step, in cold caches.)"""
        rows, ids, pos, slots = input_ids.shape[0], input_ids, positions, meta.slot_mapping
        lens, tables, i64, i32 = meta.seq_lens, meta.block_tables, torch.int64, torch.int32
        return (meta.backend == "torch" and ids.device.type == "cpu"
                and ids.dtype == i64 and pos.dtype == i64 and slots.dtype == i64 and logits_indices.dtype == i64
                and lens.dtype == i32 and tables.dtype == i32
                and ids.shape == pos.shape == slots.shape == lens.shape == (rows,)
                and tables.dim() == 2 and tables.shape[0] == rows and logits_indices.dim() == 1
                and ids.is_contiguous() and pos.is_contiguous() and slots.is_contiguous() and lens.is_contiguous()
                and tables.is_contiguous() and logits_indices.is_contiguous()
                and all(a is b for a, b in zip(self.kv_caches, self._caches)))

    def _error(self, bad: int, rows: int) -> str:
        if bad > 0:
            return (f"decode step: {bad} row(s) with a length past their block table or a block id outside "
                    f"[0, {self.cache_shape[1]})")
        if -1 - bad < rows:
            return (f"decode step: row {-1 - bad} has a token id outside [0, {self.vocab}), a position outside "
                    f"[0, {self.shape.max_positions}) or a KV slot outside the cache")
        return f"decode step: logits index {-1 - rows - bad} is not one of the step's tokens"


_INSTALLED: weakref.WeakValueDictionary[int, DecodeStep] = weakref.WeakValueDictionary()  # held by runners
_NUMBERS = itertools.count()


def _run(index: int, forward, input_ids, positions, kv_caches, meta, logits_indices):
    return _INSTALLED[index](forward, input_ids, positions, kv_caches, meta, logits_indices)
