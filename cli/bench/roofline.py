"""The machine's description and roofline: matmul peak, memory bandwidth, and the model's FLOPs and bytes.

Formulas (stated in the report and in docs/benchmarks.md):

- Useful work of a request with prompt P and output O: the model processes T = P + O - 1 tokens
  (the last sampled token is never fed back) at positions 0..T-1, and samples O tokens.
  FLOPs = T x 2 x P_layers                      (every linear layer of every decoder layer)
        + sum over positions p of 4 x L x (Hq x D) x (p + 1)   (QK^T and PV, causal context p + 1)
        + O x 2 x V x H                         (the LM head, only for sampled positions)
  where P_layers = the decoder layers' weights (no embedding, no LM head, no norms' worth counting).
  Work a system does beyond that (padding, tokens generated past a request's own length) is not
  counted, so every system is credited with the same useful FLOPs. A prompt's leading tokens that an
  earlier prompt of the workload began with too (up to all but its last token) are counted once, with
  the earlier request: what a perfect prefix cache computes (the shared-prefix workload W2).
- Engine FLOP/s = useful FLOPs / elapsed; its roofline fraction = that / measured matmul peak
  (for bf16, the higher of the bf16 and the float32 peaks: see compute_peak).
- Batch-1 decode: each step reads every weight except the embedding table (one row of it) once,
  plus the KV cache of the context. Bytes per token = (num_parameters - V x H) x dtype bytes
  + 2 x L x Hkv x D x dtype bytes x context. Bandwidth fraction = bytes per token x tokens/s /
  measured read bandwidth, against two bounds: the best reading of the whole run (probes at its
  start and end), and the best of the probes taken just before and just after that decode run.
  This VM's read bandwidth moves by half or more within minutes (docs/benchmarks.md), so the second
  compares the run with what the machine gave at the time; both are reported.
"""

from __future__ import annotations

import os
import platform
import time

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# NOTES.md's three host kinds, by what their CPUs do bf16 with (the fast path differs on each).
HOST_KINDS = {"amx": "Xeon with AMX", "avx512_bf16": "AVX-512 BF16 (Zen 4)", "avx2": "AVX2 only", "other": "other"}


def host_kind(flags: set[str] | None = None) -> str:
    """One of HOST_KINDS' keys: AMX tiles, else AVX-512 BF16 dot products, else AVX2."""
    if flags is None:
        from toolkit.backends.cpu.build import cpu_flags

        flags = set(cpu_flags().partition(":")[2].split())
    for kind, flag in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"), ("avx2", "avx2")):
        if flag in flags:
            return kind
    return "other"


def machine_info() -> dict:
    import transformers

    info = {
        "cpu": cpu_model(),
        "host_kind": host_kind(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    try:
        info["load_avg_1m"] = os.getloadavg()[0]  # other work on the machine makes figures noisy
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5, device: str | torch.device = "cpu",
                budget_s: float = 10.0) -> dict:
    """Best of up to `repeats` timings of an n^3 matmul (2 n^3 FLOPs), after one warm-up.

    A dtype without a fast kernel on this CPU (bf16 without AVX-512 BF16 runs a scalar fallback)
    would take minutes per repeat: repeats stop once `budget_s` is spent, and a warm-up slower than
    the budget is the measurement.
    """
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    # A 256^3 probe first: where the dtype is slow, shrink n so one matmul takes about a second.
    probe = torch.randn(256, 256, generator=g).to(device=device, dtype=dtype)
    _matmul(probe, probe)
    _sync(device)
    start = time.perf_counter()
    _matmul(probe, probe)
    _sync(device)
    rate = 2 * 256**3 / max(time.perf_counter() - start, 1e-9)
    if 2 * n**3 / rate > 3 * budget_s:  # a small probe underestimates big matmuls: shrink only when far off
        n = max(min(n, 256), int((rate / 2) ** (1 / 3)) // 64 * 64)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    start = time.perf_counter()
    _matmul(a, b)
    _sync(device)
    best = spent = time.perf_counter() - start
    for _ in range(repeats):
        if spent > budget_s:
            break
        start = time.perf_counter()
        _matmul(a, b)
        _sync(device)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "seconds": best, "flops_per_s": 2 * n**3 / best}


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # F.linear (a @ b.T, the same FLOPs), not torch.mm: it is what model layers call, and the two take
    # different kernels for some dtypes (bf16 on an AVX2 CPU: mm is an order of magnitude slower).
    return torch.nn.functional.linear(a, b)


def memory_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5, device: str | torch.device = "cpu") -> dict:
    """Read bandwidth from summing a large float32 tensor, and copy bandwidth (read + write) from copy_."""
    device = torch.device(device)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    read = copy = float("inf")
    src.sum(), dst.copy_(src)
    for _ in range(repeats):
        start = time.perf_counter()
        src.sum()
        _sync(device)
        read = min(read, time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        copy = min(copy, time.perf_counter() - start)
    return {"bytes": nbytes, "read_bytes_per_s": nbytes / read, "copy_bytes_per_s": 2 * nbytes / copy}


def best_of_probes(*probes: dict) -> dict:
    """One figure from probes of the same kind taken at different times: the best of each rate.

    This VM's matmul peak moves by a third or more between runs minutes apart; a single probe taken
    in a slow minute made a run's engines look above 95% of "peak". The machine can do at least
    what it showed once, so the highest reading is the roofline; every reading is kept in the JSON.
    """
    rate_keys = [k for k in probes[0] if k.endswith("_per_s") and not k.endswith("_samples")]
    best = dict(max(probes, key=lambda p: p[rate_keys[0]]))  # a copy: the probes stay as taken
    for k in rate_keys:
        samples = [x for p in probes for x in p.get(f"{k}_samples", [p[k]])]
        best[k], best[f"{k}_samples"] = max(samples), samples
    return best


def compute_peak(peak: dict, other_peak: dict) -> dict:
    """The roofline for the model's dtype: its own matmul probe, or float32's where that is higher.

    A bf16 product is exact in float32, so widening bf16 to float32 and using float32 FMAs computes
    the same matmul; a CPU without bf16 units (AVX2) has no faster way to it, and torch's emulated
    bf16 kernel there (several times slower than float32) is not the machine's peak. Without this, an
    engine that widens (ours, toolkit/backends/cpu/csrc/linear.cpp) would read as several times "peak".
    """
    if peak["dtype"] != "float32" and other_peak["dtype"] == "float32" and other_peak["flops_per_s"] > peak["flops_per_s"]:
        return other_peak
    return peak


def layer_linear_params(mc) -> int:
    """Weights of the decoder layers' linear maps (q, k, v, o, gate, up, down), all layers, that one
    token is computed with: in a MoE layer the router, its top_k experts and any shared expert."""
    h, d = mc.hidden_size, mc.head_dim
    attn = h * d * (2 * mc.num_heads + 2 * mc.num_kv_heads)
    mlp = 3 * h * mc.intermediate_size
    if mc.moe is None:
        return mc.num_layers * (attn + mlp)
    sparse = sum(mc.moe.sparse_layers)
    return mc.num_layers * attn + (mc.num_layers - sparse) * mlp + sparse * mc.moe.layer_parameters(h, active=True)


def request_flops(mc, prompt_len: int, output_len: int, shared: int = 0) -> float:
    """Useful FLOPs of one request whose first `shared` positions an earlier request computed (see the
    module docstring)."""
    t = prompt_len + output_len - 1
    linear = 2.0 * layer_linear_params(mc) * (t - shared)
    attention = 4.0 * mc.num_layers * mc.num_heads * mc.head_dim * (t * (t + 1) / 2 - shared * (shared + 1) / 2)
    lm_head = 2.0 * mc.vocab_size * mc.hidden_size * output_len
    return linear + attention + lm_head


def shared_prefix_lens(prompts: list[list[int]]) -> list[int]:
    """Per prompt, how many of its leading tokens an earlier prompt began with too (at most all but its
    last, which is computed to sample from): a token trie of the prompts in order."""
    root: dict = {}
    shared = []
    for prompt in prompts:
        node, n = root, 0
        while n < len(prompt) and prompt[n] in node:
            node, n = node[prompt[n]], n + 1
        shared.append(min(n, max(len(prompt) - 1, 0)))
        for token in prompt[n:]:
            node = node.setdefault(token, {})
    return shared


def workload_flops(mc, requests) -> float:
    shared = shared_prefix_lens([r.prompt_token_ids for r in requests])
    return sum(request_flops(mc, r.prompt_len, r.output_len, s) for r, s in zip(requests, shared))


def decode_bytes_per_token(mc, dtype_bytes: int, context: float, weight_bytes: float | None = None) -> float:
    """Bytes one batch-1 decode step reads: all weights but the embedding table (of a MoE model only
    the experts the token is routed to), `weight_bytes` each (default: the dtype's; 1 under weight-only
    int8, whose scales and norms are noise), and the context's KV."""
    # Untied: the embedding table is only indexed (one row); tied: it is the LM head, read whole.
    unread = 0 if mc.tie_word_embeddings else mc.vocab_size * mc.hidden_size
    weights = (mc.num_active_parameters - unread) * (dtype_bytes if weight_bytes is None else weight_bytes)
    kv = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * dtype_bytes * context
    return weights + kv


def bandwidth_fraction(bytes_per_token: float, runs: list[tuple[int, float, float]]) -> float:
    """Percent of the memory-bandwidth bound that decode runs reached, each run (tokens, seconds,
    read bytes/s it is held to): the time the bound needs for every run's tokens over the time they
    took. One run: bytes_per_token * tokens/s / bandwidth."""
    bound_s = sum(tokens * bytes_per_token / rate for tokens, _, rate in runs)
    took_s = sum(seconds for _, seconds, _ in runs)
    return 100.0 * bound_s / took_s if took_s > 0 else 0.0


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
