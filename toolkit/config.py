"""The configuration tree: `EngineConfig` (what the user asks for) and `ModelConfig` (the checkpoint).

`EngineConfig` is passed down whole: the engine resolves its open choices once (`resolve`: the
device, the dtype, the context length, the attention backend) and every part reads the fields it
needs from that one object. Environment variables only set some fields' defaults (toolkit/envs.py).

Model configs are parsed by `transformers.AutoConfig`, which understands every spelling of every key
(old `rope_theta`/`rope_scaling` and new `rope_parameters`, `torch_dtype` and `dtype`, ...). This
module turns that into one flat, validated `ModelConfig`, and refuses options the model code does
not implement instead of silently computing something else.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from toolkit import envs

# Architectures served by the dense decoder family in `toolkit.models.llama`.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # Mixture-of-experts decoders: the same layers, with routed experts as the MLP (toolkit/models/moe.py).
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
# Config fields of other MoE families that change the routing, and the value at which they change
# nothing: a checkpoint setting another value is refused rather than routed differently.
NEUTRAL_ROUTING_OPTIONS = {"scoring_func": "softmax", "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                           "routed_scaling_factor": 1.0, "n_shared_experts": 0, "moe_layer_freq": 1,
                           "first_k_dense_replace": 0}
# RoPE variants whose inverse frequencies do not depend on the sequence being run.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class UnsupportedModelError(ValueError):
    """The checkpoint asks for an architecture or option the toolkit does not implement."""


ATTENTION_BACKENDS = ("torch", "triton", "cpu")


# The features whose combinations are checked, by the name an error gives them, and whether a config sets each.
FEATURES = {
    "disaggregated prefill/decode": lambda c: c.prefill_instances > 0,
    "tensor_parallel_size": lambda c: c.tensor_parallel_size > 1,
    "data_parallel_size": lambda c: c.data_parallel_size > 1,
    "pipeline_parallel_size": lambda c: c.pipeline_parallel_size > 1,
    "enable_expert_parallel": lambda c: c.enable_expert_parallel,
    "speculative_config": lambda c: c.speculative_config is not None,
    "kv_offloading_size": lambda c: c.kv_offloading_size is not None,
    "kv_disk_cache_dir": lambda c: c.kv_disk_cache_dir is not None,
    "preemption_mode='swap'": lambda c: c.preemption_mode == "swap",
    "enable_prefix_caching": lambda c: c.enable_prefix_caching,
    "max_num_batched_tokens": lambda c: True,  # chunked prefill: always on
    "quantization='int8'": lambda c: c.quantization == "int8",
}

NOT_COMBINED = {
    frozenset(("quantization='int8'", "tensor_parallel_size")): "the tensor-parallel plan splits float weights, not "
                                                                "int8 ones with their scales: drop one",
}


@dataclass
class EngineConfig:
    """Everything an engine is built from. `LLM(model, **fields)` takes the same names (vLLM's)."""

    model: str
    dtype: str | torch.dtype = "auto"
    device: str | torch.device | None = None  # None: cuda when available, else cpu
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None  # None: 0.9 of free memory on CUDA, 0.3 on a CPU host
    # The longest request (prompt + output tokens) the workload will bring, when known (the CLI sets it
    # from its input): the KV cache is then sized for max_num_seqs such requests, not max_model_len ones.
    # A longer request still runs while the cache holds it, or fails alone (toolkit/kv_sizing.py).
    max_request_tokens: int | None = None
    # vLLM's: the share of the GPU's total memory this engine may hold; the KV cache gets what the weights
    # (and whatever else is on the GPU) leave of it. Not used on CPU, where kv_cache_memory_fraction sizes it.
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False
    # None: the device backend's own (triton on CUDA, the C++ kernels on CPU where built, else torch).
    attention_backend: str | None = None
    scheduling_policy: str = "fcfs"
    seed: int | None = 0
    skip_tokenizer_init: bool = False
    tokenizer: str | None = None  # a folder with the tokenizer files (vLLM's name); None: the model folder
    # Accepted for vLLM's sake: the toolkit runs only its own model code, never a checkpoint's.
    trust_remote_code: bool = False
    # Default SamplingParams (LLM.get_default_sampling_params): "auto" reads the model folder's
    # generation_config.json, "vllm" uses vLLM's defaults, any other value is a folder holding one.
    generation_config: str = "auto"
    # vLLM's meaning; tp * dp processes started by torchrun (see parallel/). 1 x 1: one process.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # vLLM's: the layers cut into this many stages, one process each (x tp), with up to this many step
    # plans in flight (parallel/pipeline.py); world = dp x pp x tp.
    pipeline_parallel_size: int = 1
    # Layers per stage, e.g. "4,4,5,3"; None: vLLM's even split (leftovers to the stages before the last).
    pp_layer_partition: str | None = None
    # vLLM's: MoE layers' experts split over all tp x dp ranks (all-to-all dispatch) instead of each
    # expert split tp ways; attention stays tensor/data parallel (parallel/expert_parallel.py).
    enable_expert_parallel: bool = False
    # Disaggregated prefill and decode (toolkit/disaggregated.py): this many prefill instances and decode
    # instances, each of pipeline_parallel_size x tensor_parallel_size ranks (prefill ones of
    # prefill_pipeline_parallel_size x prefill_tensor_parallel_size, where set), each decode instance
    # data_parallel_size replicas (routed apart; under expert parallelism splitting the experts and
    # stepping together); world = P x prefill pp x prefill tp + D x dp x pp x tp. 0 and 0: every rank
    # both prefills and decodes.
    prefill_instances: int = 0
    decode_instances: int = 0
    prefill_tensor_parallel_size: int | None = None
    prefill_pipeline_parallel_size: int | None = None
    # The most requests a prefill instance holds at once: computing, or their KV staged until the decode
    # side has taken it; and the most a decode instance receives ahead of admitting them. Past it the
    # next ones wait, so the staged KV stays bounded on both sides.
    prefill_backlog: int = 64
    # Conditional disaggregation (NVIDIA Dynamo's max_local_prefill_length): a prompt of at most this many
    # tokens is computed by its decode instance, not handed over. 0: every prompt of 2+ tokens is.
    max_local_prefill_tokens: int = 0
    # The reverse: a prefill instance also serves whole requests (prefill and decode, after the prompts
    # it hands over) while the work routed to it stays below its decode instance's, an output token
    # counted as this many prompt tokens (what one costs relative to a prompt token at the decode
    # instance's batch size; parallel/disaggregated.py's Router). 0: a prefill instance only prefills.
    decode_token_cost: float = 0.0
    load_format: str = "safetensors"  # "dummy": seeded random weights of the checkpoint's shapes (benchmarks)
    compile_backend: str = "inductor"  # torch.compile backend; "eager" traces without Inductor (debugging, tests)
    cuda_graphs: bool = True  # on CUDA with the Triton backend, replay captured graphs for decode-only steps
    # CPU only (toolkit/backends/cpu/). Build and use the C++ kernels (linear, attention).
    cpu_kernels: bool = field(default_factory=envs.cpu_kernels)
    # Which linear serves which row counts: "auto" measures the panel kernel against oneDNN on the
    # model's shapes at start (cached); "panel", "onednn" force one; "torch" keeps plain nn.Linear.
    cpu_linear: str = field(default_factory=envs.cpu_linear)
    # Which prefill chunks the CPU attention op hands to ATen's flash attention (GEMMs on the CPU's matrix
    # units) instead of its own tiles: "auto" measures from which chunk length that pays, on the model's
    # head shape at start (cached); "flash" sends every chunk of 2+ tokens, "tiles" none
    # (toolkit/backends/cpu/attention_plan.py).
    cpu_prefill_attention: str = field(default_factory=envs.cpu_prefill_attention)
    # Compiled CPU steps run Inductor's C++ wrapper: no Python between the kernels of a step.
    cpp_wrapper: bool = field(default_factory=envs.cpp_wrapper)
    # Compiled CPU steps are saved under $TOOLKIT_CACHE/compiled and loaded at the next start instead of
    # traced again (toolkit/compiled_cache.py).
    compile_cache: bool = field(default_factory=envs.compile_cache)
    # Weight-only quantization at load, from any checkpoint (toolkit/quantization.py): None, or "int8"
    # (one float32 scale per output channel; activations stay in dtype). Halves bf16's weight bytes.
    quantization: str | None = None
    # vLLM's dict (speculative/config.py): {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}
    speculative_config: dict | str | object | None = None
    # The KV memory hierarchy (toolkit/kv_hierarchy.py). Prefix caching shares computed blocks by name.
    enable_prefix_caching: bool = True
    kv_offloading_size: float | None = None  # GiB of host memory for a CPU tier of evicted blocks
    kv_offloading_backend: str = "native"
    kv_disk_cache_dir: str | None = None  # a directory for a disk tier that outlives the process
    kv_disk_cache_size: float = 10.0  # GiB the disk tier may use
    preemption_mode: str = "recompute"  # or "swap": a preempted request's KV goes to the CPU tier

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "data_parallel_size",
                     "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_request_tokens is not None and (not isinstance(self.max_request_tokens, numbers.Integral)
                                                    or isinstance(self.max_request_tokens, bool)
                                                    or self.max_request_tokens < 1):
            raise ValueError(f"max_request_tokens must be an integer >= 1, got {self.max_request_tokens!r}")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        self._check_vllm_fields()
        from toolkit.quantization import QUANTIZATIONS

        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization={self.quantization!r} is not supported: None or 'int8' (weight-only, "
                             "quantized at load from the checkpoint's weights); quantized checkpoints (AWQ, GPTQ, "
                             "FP8) are not implemented")
        if self.quantization is not None and (self.prefill_tensor_parallel_size or 1) > 1:
            raise ValueError("quantization='int8' does not combine with prefill_tensor_parallel_size > 1 yet: the "
                             "tensor-parallel plan splits float weights, not int8 ones with their scales")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        from toolkit.sampling_params import SEED_MAX, SEED_MIN

        if self.seed is not None and (not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be None or an int in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        self._check_kv_hierarchy()
        from toolkit.speculative.config import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self._check_pipeline()
        self._check_disaggregated()
        self._check_combinations()
        if self.cpu_linear not in envs.CPU_LINEAR_CHOICES:
            raise ValueError(f"cpu_linear must be one of {', '.join(envs.CPU_LINEAR_CHOICES)}, got {self.cpu_linear!r}")
        if self.cpu_prefill_attention not in envs.CPU_PREFILL_ATTENTION_CHOICES:
            raise ValueError(f"cpu_prefill_attention must be one of {', '.join(envs.CPU_PREFILL_ATTENTION_CHOICES)}, "
                             f"got {self.cpu_prefill_attention!r}")

    def _check_vllm_fields(self) -> None:
        util = self.gpu_memory_utilization
        if util is not None:
            if not isinstance(util, numbers.Real) or isinstance(util, bool) or not 0 < util <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
            if self.kv_cache_memory_bytes is not None or self.kv_cache_memory_fraction is not None:
                raise ValueError("gpu_memory_utilization and kv_cache_memory_bytes/kv_cache_memory_fraction both "
                                 "size the KV cache: pass one")
        if not isinstance(self.trust_remote_code, bool):
            raise ValueError(f"trust_remote_code must be a bool, got {self.trust_remote_code!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")

    def _check_pipeline(self) -> None:
        if self.pp_layer_partition is not None and not isinstance(self.pp_layer_partition, str):
            raise ValueError(f"pp_layer_partition must be a string such as '4,4,5,3', got {self.pp_layer_partition!r}")

    def _check_combinations(self) -> None:
        """The pairs of features set here that do not combine yet (NOT_COMBINED), refused before anything loads."""
        on = [name for name, is_on in FEATURES.items() if is_on(self)]
        for a in on:
            others = [b for b in on if frozenset((a, b)) in NOT_COMBINED]
            if others:
                raise ValueError(f"{a} does not combine with {', '.join(others)} yet: "
                                 f"{NOT_COMBINED[frozenset((a, others[0]))]}")

    @property
    def disaggregated(self) -> bool:
        return self.prefill_instances > 0

    def _check_disaggregated(self) -> None:
        """Instance counts, and what disaggregation does not combine with yet, before anything loads."""
        for name in ("prefill_instances", "decode_instances"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.prefill_backlog, numbers.Integral) or isinstance(self.prefill_backlog, bool) \
                or self.prefill_backlog < 1:
            raise ValueError(f"prefill_backlog must be an integer >= 1, got {self.prefill_backlog!r}")
        for name in ("prefill_tensor_parallel_size", "prefill_pipeline_parallel_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        local = self.max_local_prefill_tokens
        if not isinstance(local, numbers.Integral) or isinstance(local, bool) or local < 0:
            raise ValueError(f"max_local_prefill_tokens must be an integer >= 0, got {local!r}")
        cost = self.decode_token_cost
        if not isinstance(cost, numbers.Real) or isinstance(cost, bool) or not 0 <= cost < math.inf:
            raise ValueError(f"decode_token_cost must be a finite number >= 0, got {cost!r}")
        if (self.prefill_instances > 0) != (self.decode_instances > 0):
            raise ValueError(f"prefill_instances {self.prefill_instances} and decode_instances {self.decode_instances}: "
                             "disaggregation needs at least one of each (or 0 and 0 to colocate)")
        if not self.disaggregated:
            for name in ("prefill_tensor_parallel_size", "prefill_pipeline_parallel_size"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs prefill_instances and decode_instances")
            if self.max_local_prefill_tokens:
                raise ValueError("max_local_prefill_tokens needs prefill_instances and decode_instances")
            if self.decode_token_cost:
                raise ValueError("decode_token_cost needs prefill_instances and decode_instances")

    def _check_kv_hierarchy(self) -> None:
        for name in ("kv_offloading_size", "kv_disk_cache_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, numbers.Real) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive number of GiB, got {value!r}")
        if self.kv_offloading_backend != "native":
            raise ValueError(f"kv_offloading_backend must be 'native' (the toolkit's CPU tier), "
                             f"got {self.kv_offloading_backend!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.kv_offloading_size is None:
            raise ValueError("preemption_mode='swap' swaps to the CPU tier: set kv_offloading_size (GiB) too")

    def resolve(self, model_config: "ModelConfig", device: torch.device) -> "EngineConfig":
        """A copy with the model-dependent choices made: a torch dtype, the device, max_model_len.
        (The attention backend is the device backend's to choose: toolkit/backends.)"""
        max_model_len = self.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                             f"{model_config.max_position_embeddings}")
        return replace(self, dtype=resolve_dtype(self.dtype, model_config.checkpoint_dtype), device=torch.device(device),
                       max_model_len=max_model_len)


@dataclass(frozen=True)
class MoEConfig:
    """The routed experts of a mixture-of-experts checkpoint (None on a dense ModelConfig).

    Routing (toolkit/models/moe.py): softmax over the router's logits in float32, the top `top_k`
    experts, their weights renormalized to sum 1 when `renormalize`; `weights_in_model_dtype`: the
    weights are rounded to the model's dtype before use (Qwen2-MoE/Qwen3-MoE in transformers; Mixtral
    keeps them float32)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    renormalize: bool
    weights_in_model_dtype: bool
    sparse_layers: tuple[bool, ...]  # per layer: routed experts (True) or the dense MLP
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert; 0: none

    def expert_parameters(self, hidden_size: int) -> int:
        return 3 * hidden_size * self.intermediate_size

    def layer_parameters(self, hidden_size: int, active: bool = False) -> int:
        """A sparse layer's MLP: router, routed experts (only the top_k a token uses when `active`),
        and the shared expert with its gate."""
        n = self.num_experts * hidden_size
        n += (self.top_k if active else self.num_experts) * self.expert_parameters(hidden_size)
        if self.shared_expert_intermediate_size:
            n += 3 * hidden_size * self.shared_expert_intermediate_size + hidden_size
        return n


@dataclass
class ModelConfig:
    path: str
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    checkpoint_dtype: torch.dtype
    hf_config: object  # the transformers PretrainedConfig, kept for RoPE and the TP plans
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    moe: MoEConfig | None = None  # mixture-of-experts families only

    @property
    def num_parameters(self) -> int:
        """Parameter count computed from the shapes (tied embeddings counted once)."""
        return self._count_parameters(active=False)

    @property
    def num_active_parameters(self) -> int:
        """Parameters one token is computed with: a MoE layer counts only its top_k routed experts
        (the router and the shared expert in full). The total for a dense model."""
        return self._count_parameters(active=True)

    def _count_parameters(self, active: bool) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.o_bias:
            attn += h
        mlp = 3 * h * self.intermediate_size
        if self.mlp_bias:
            mlp += 2 * self.intermediate_size + h
        norms = 2 * h + (2 * d if self.qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        sparse = 0 if self.moe is None else sum(self.moe.sparse_layers)
        moe = 0 if self.moe is None else sparse * self.moe.layer_parameters(h, active)
        return self.num_layers * (attn + norms) + (self.num_layers - sparse) * mlp + moe + embed + h


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # float32 checkpoints stay float32; like vLLM, 'auto' means "what the checkpoint says".
        return checkpoint_dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(sorted(DTYPES))}; got {dtype!r}")
    return DTYPES[dtype]


def load_model_config(path: str | os.PathLike) -> ModelConfig:
    """A Hugging Face model folder's config.json, or a GGUF file's metadata (toolkit/gguf_checkpoint.py)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        from toolkit.gguf_checkpoint import hf_config

        hf = hf_config(path)
    else:
        if not path.is_dir():
            raise FileNotFoundError(f"model folder not found: {path}")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in model folder {path}")
        hf = _read_hf_config(path)
    arch = _architecture(hf, path)
    _check_supported_options(hf, arch)

    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    dtype = getattr(hf, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype, torch.float32)
    family = SUPPORTED_ARCHITECTURES[arch]
    eos = hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return ModelConfig(
        path=str(path),
        architecture=arch,
        family=family,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        intermediate_size=hf.intermediate_size,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no o bias (Qwen2-MoE says so with qkv_bias); Llama-style
        # configs say it with attention_bias.
        qkv_bias=(True if family == "qwen2" else bool(getattr(hf, "qkv_bias", True)) if family == "qwen2_moe"
                  else bool(getattr(hf, "attention_bias", False))),
        o_bias=False if family in ("qwen2", "qwen2_moe") else bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        checkpoint_dtype=dtype,
        hf_config=hf,
        eos_token_ids=eos_ids,
        bos_token_id=getattr(hf, "bos_token_id", None),
        moe=_moe_config(hf, arch, family) if family in MOE_FAMILIES else None,
    )


def _moe_config(hf, arch: str, family: str) -> MoEConfig:
    """The routed experts as transformers builds them (Mixtral: every layer, always renormalized;
    Qwen2-MoE/Qwen3-MoE: norm_topk_prob, dense layers per mlp_only_layers and decoder_sparse_step)."""
    for name, neutral in NEUTRAL_ROUTING_OPTIONS.items():
        value = getattr(hf, name, None)
        if value is not None and value != neutral:
            raise UnsupportedModelError(f"{arch}: {name}={value!r} changes the expert routing and is not implemented "
                                        f"(only {name}={neutral!r})")
    # Not checked: Mixtral's router_jitter_noise multiplies the router's input by noise in training only
    # (transformers skips it in eval mode, as here); output_router_logits and router_aux_loss_coef feed
    # the training loss.
    num_experts = hf.num_local_experts if family == "mixtral" else hf.num_experts
    top_k = hf.num_experts_per_tok
    if num_experts > 0 and not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(f"{arch}: num_experts_per_tok={top_k} must be in [1, {num_experts}] (the experts)")
    if family == "mixtral":
        return MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=hf.intermediate_size,
                         renormalize=True, weights_in_model_dtype=False, sparse_layers=(True,) * hf.num_hidden_layers)
    step = hf.decoder_sparse_step
    if step < 1:
        raise UnsupportedModelError(f"{arch}: decoder_sparse_step={step} must be >= 1")
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    sparse = tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(hf.num_hidden_layers))
    shared = hf.shared_expert_intermediate_size if family == "qwen2_moe" else 0
    if family == "qwen2_moe" and shared < 1:
        raise UnsupportedModelError(f"{arch}: shared_expert_intermediate_size={shared} (a shared expert of no size) "
                                    "is not implemented")
    return MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=hf.moe_intermediate_size,
                     renormalize=bool(hf.norm_topk_prob), weights_in_model_dtype=True, sparse_layers=sparse,
                     shared_expert_intermediate_size=shared)


def _read_hf_config(path: Path):
    from transformers import AutoConfig

    _check_named_architecture(path)
    try:
        return AutoConfig.from_pretrained(path)  # never trust_remote_code: the toolkit runs only its own model code
    except ValueError:
        raw = json.loads((path / "config.json").read_text())
        if "auto_map" not in raw:
            raise
        # transformers' message would say "set trust_remote_code=True", which cannot help here.
        named = ", ".join(raw.get("architectures") or []) or "none named in config.json"
        raise UnsupportedModelError(f"unsupported architecture in {path}: {named} (the checkpoint's own code); "
                                    f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}") from None


def _check_named_architecture(path: Path) -> None:
    """An architecture the toolkit does not run, said in one line before transformers (whose error for
    a model type it does not know is several lines of advice to upgrade it)."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnsupportedModelError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"{path / 'config.json'} is not a JSON object")
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        named = ", ".join(map(str, archs))
    elif not archs and model_type is not None and model_type not in SUPPORTED_ARCHITECTURES.values():
        named = f"model_type {model_type!r}"
    else:
        return
    raise UnsupportedModelError(f"unsupported architecture in {path}: {named}; the toolkit runs "
                                f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _architecture(hf, path) -> str:
    archs = getattr(hf, "architectures", None) or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    named = ", ".join(archs) or "none named in config.json"
    raise UnsupportedModelError(
        f"unsupported architecture in {path}: {named}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _check_supported_options(hf, arch: str) -> None:
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{arch}: hidden_act={act!r} is not implemented (only 'silu')")
    layer_types = getattr(hf, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise UnsupportedModelError(f"{arch}: layer types {other} (sliding window attention) are not implemented")
    rope = rope_parameters(hf)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{arch}: rope_type={rope_type!r} is not implemented; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )


def check_device(config: EngineConfig) -> None:
    """A device (and attention backend) this torch can run, checked before anything loads."""
    if config.device is not None:
        try:
            device = torch.device(config.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {config.device!r}") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {config.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r} is not available: this torch "
                             f"{'has no CUDA support' if torch.version.cuda is None else 'sees no GPU'}")
    on_cuda = torch.cuda.is_available() if config.device is None else torch.device(config.device).type == "cuda"
    if config.attention_backend == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' needs a CUDA device (on CPU: cpu or torch)")


def check_sliding_window(config: ModelConfig, max_model_len: int) -> None:
    """A sliding window only changes results once a sequence is longer than the window."""
    window = getattr(config.hf_config, "sliding_window", None)
    if getattr(config.hf_config, "use_sliding_window", True) is False:
        window = None  # Qwen2-MoE writes sliding_window=0 when use_sliding_window is off
    if window is not None and window < max_model_len:
        raise UnsupportedModelError(
            f"{config.architecture}: sliding window attention (window {window}) is not implemented; "
            f"use max_model_len <= {window} (got {max_model_len})"
        )


def rope_parameters(hf) -> dict:
    params = getattr(hf, "rope_parameters", None)
    if params is None:  # transformers 4.x spelling
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return dict(params)


def rope_inv_freq(hf) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling, computed by transformers' own RoPE functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = rope_parameters(hf).get("rope_type", "default")
    if rope_type == "default":
        base = rope_parameters(hf)["rope_theta"]
        dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
