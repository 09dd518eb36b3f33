"""vLLM's `LLM(...)` keyword arguments that have no EngineConfig field: each is accepted at the values
where the toolkit already does what it asks, and any other value is a ValueError naming the argument
and why, so a script written for vLLM either runs as written or stops. Keywords neither vLLM's nor
EngineConfig's stay a TypeError (EngineConfig's own)."""

from __future__ import annotations

import numbers


def _none(value) -> bool:
    return value is None


def _bool(value) -> bool:
    return isinstance(value, bool)


def _zero(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == 0


def _gib(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value >= 0


_LOCAL_ONLY = "the toolkit loads a local folder and downloads nothing: pass the folder of the checkout you want"

# name: (accepts(value), why any other value is refused, or what the accepted value means)
VLLM_ONLY = {
    "revision": (_none, _LOCAL_ONLY),
    "tokenizer_revision": (_none, _LOCAL_ONLY),
    "code_revision": (_none, _LOCAL_ONLY),
    "download_dir": (_none, _LOCAL_ONLY),
    "hf_token": (lambda v: v is None or v is False, _LOCAL_ONLY),
    "tokenizer_mode": (lambda v: v in ("auto", "hf"),
                       "must be 'auto': the tokenizer is the checkpoint's own, loaded by transformers' AutoTokenizer"),
    "kv_cache_dtype": (lambda v: v == "auto", "must be 'auto': the KV cache is kept in the model's dtype "
                                              "(fp8 KV caches are not implemented)"),
    "cpu_offload_gb": (_zero, "must be 0: offloading weights to CPU memory is not implemented"),
    "enable_chunked_prefill": (lambda v: v is None or v is True,
                               "long prefills are always chunked by max_num_batched_tokens; to run every prompt "
                               "in one step, set max_num_batched_tokens >= max_model_len"),
    # Accepted and unused: what they turn off does not exist here.
    "swap_space": (_gib, "must be a number of GiB >= 0; unused, as in vLLM's V1 engine: preempted requests "
                         "recompute, or with preemption_mode='swap' go to the kv_offloading_size GiB CPU tier"),
    "disable_log_stats": (_bool, "must be a bool; the offline engine logs no periodic stats either way"),
    "disable_custom_all_reduce": (_bool, "must be a bool; tensor parallelism always uses torch.distributed's "
                                         "all-reduce"),
}


def engine_kwargs(kwargs: dict) -> dict:
    """`kwargs` without the vLLM-only keywords, each checked (ValueError naming it) and dropped."""
    rest = dict(kwargs)
    for name, (accepts, why) in VLLM_ONLY.items():
        if name in rest:
            value = rest.pop(name)
            if not accepts(value):
                raise ValueError(f"{name}={value!r} is not supported: {why}")
    return rest
