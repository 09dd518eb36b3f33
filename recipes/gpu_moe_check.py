"""MoE on a GPU (part of recipes/gpu_check.sh): the Triton grouped-GEMM experts kernel against the torch
reference at real layer shapes, and the engine on tiny MoE checkpoints against transformers.

1. kernel: `toolkit.moe.triton_moe.fused_experts_triton` and the torch reference
   (`toolkit.moe.ops.moe_experts_torch`) in float32, bfloat16 and float16, on Mixtral-8x7B-,
   Qwen1.5-MoE- and Qwen3-30B-A3B-shaped layers, for decode-sized to prefill-sized token counts, both
   measured against the reference run in float64 on the same (rounded) inputs: the kernel's error must
   stay within twice the reference's (plus a floor of 1e-5 of the output's scale). Also: two expert
   "ranks" (first_expert 0 and E/2, half the experts each) sum to the whole layer; a CUDA graph
   captured once replays correctly on new routings (the align step never syncs with the host);
   both implementations' times are reported.
2. parity: the seeded random MoE checkpoints of the tests (tests/checkpoints.py MOE_FAMILIES: Mixtral,
   Qwen2-MoE with its shared expert and a dense layer, Qwen3-MoE), written with save_pretrained:
   float32 greedy tokens of the engine on CUDA equal transformers', eager, compiled, and compiled
   with CUDA-graph decode steps, and the Triton kernel is what served the experts (calls counted).

    python recipes/gpu_moe_check.py --out /tmp/gpu_check/moe.json
    python recipes/gpu_moe_check.py --device cpu   # here, to try the script: tiny kernel shapes under
        # TRITON_INTERPRET=1 (no bf16: the interpreter's bf16 tl.dot is wrong), and parity on the CPU
        # eager with the reference, then with the Triton kernel (interpreted) serving the experts
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (experts, top_k, hidden, intermediate of one expert)
LAYERS = {"mixtral_8x7b": (8, 2, 4096, 14336), "qwen1.5_moe_a2.7b": (60, 4, 2048, 1408),
          "qwen3_30b_a3b": (128, 8, 2048, 768)}
TOKENS = (1, 7, 64, 333, 2048)
TINY_LAYERS = {"tiny": (6, 2, 48, 40)}
TINY_TOKENS = (1, 13)

MODES = {"eager": dict(enforce_eager=True), "compiled": dict(cuda_graphs=False), "compiled+cudagraphs": {}}


def sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, reps=10):
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3  # median, ms


def random_layer(num_experts, top_k, hidden, inter, num_tokens, dtype, device, seed):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g, device=device) / inter**0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=g, device=device)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    return x, w13, w2, (weights / weights.sum(-1, keepdim=True)).float(), ids


def kernel_checks(device, report):
    import torch

    from toolkit.moe.ops import moe_experts_torch
    from toolkit.moe.triton_moe import fused_experts_triton

    small = device == "cpu"
    dtypes = (torch.float32, torch.float16) if small else (torch.float32, torch.bfloat16, torch.float16)
    failures = 0
    rows = []
    for name, (e, k, h, i) in (TINY_LAYERS if small else LAYERS).items():
        for dtype in dtypes:
            for t in TINY_TOKENS if small else TOKENS:
                x, w13, w2, weights, ids = random_layer(e, k, h, i, t, dtype, device, seed=t)
                exact = moe_experts_torch(x.double(), w13.double(), w2.double(), weights, ids).float()
                out = fused_experts_triton(x, w13, w2, weights, ids)
                ref = moe_experts_torch(x, w13, w2, weights, ids)
                scale = exact.abs().max().item()
                err = (out.float() - exact).abs().max().item()
                ref_err = (ref.float() - exact).abs().max().item()
                ok = bool(out.dtype == dtype and err <= 2 * ref_err + 1e-5 * scale)
                row = {"layer": name, "dtype": str(dtype).removeprefix("torch."), "tokens": t, "ok": ok,
                       "max_err": err, "reference_max_err": ref_err, "scale": scale}
                if not small and dtype != torch.float32:
                    row["triton_ms"] = timed(lambda: fused_experts_triton(x, w13, w2, weights, ids), device)
                    row["reference_ms"] = timed(lambda: moe_experts_torch(x, w13, w2, weights, ids), device)
                failures += not ok
                rows.append(row)
                print(json.dumps(row), flush=True)
                del x, w13, w2, exact, out, ref
            if device == "cuda":
                torch.cuda.empty_cache()
    report["kernel"] = rows

    # Expert parallelism: two ranks holding half the experts each sum to the whole layer.
    e, k, h, i = (6, 2, 48, 40) if small else (8, 2, 1024, 1408)
    x, w13, w2, weights, ids = random_layer(e, k, h, i, 37, torch.float32, device, seed=5)
    half = e // 2
    whole = fused_experts_triton(x, w13, w2, weights, ids)
    split = fused_experts_triton(x, w13[:half], w2[:half], weights, ids, 0) + \
        fused_experts_triton(x, w13[half:], w2[half:], weights, ids, half)
    ep_err = (whole - split).abs().max().item()
    report["expert_parallel_split_max_err"] = ep_err
    failures += not ep_err <= 1e-5 * whole.abs().max().item()
    print(json.dumps({"expert_parallel_split_max_err": ep_err}), flush=True)

    if device == "cuda":
        # Captured once, replayed on other routings (same shapes): nothing in the op may sync or
        # size anything from the routing's values.
        e, k, h, i = LAYERS["qwen3_30b_a3b"]
        x, w13, w2, weights, ids = random_layer(e, k, h, i, 8, torch.bfloat16, device, seed=1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fused_experts_triton(x, w13, w2, weights, ids)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fused_experts_triton(x, w13, w2, weights, ids)
        replays = []
        for seed in (2, 3, 4):
            new_x, _, _, new_weights, new_ids = random_layer(e, k, h, i, 8, torch.bfloat16, device, seed=seed)
            if seed == 4:
                new_ids[:] = 3  # every slot on one expert (duplicates: the worst skew)
            x.copy_(new_x), weights.copy_(new_weights), ids.copy_(new_ids)
            graph.replay()
            replays.append(torch.equal(captured, fused_experts_triton(x, w13, w2, weights, ids)))
        report["cuda_graph_replays_equal_eager"] = replays
        failures += not all(replays)
        print(json.dumps({"cuda_graph_replays_equal_eager": replays}), flush=True)
    return failures


def parity_checks(device, report):
    import torch

    from tests.checkpoints import MOE_FAMILIES, hf_greedy, random_prompts, write_checkpoint
    from toolkit import LLM, SamplingParams
    from toolkit.moe import ops
    from toolkit.moe.triton_moe import fused_experts_triton

    calls = {"n": 0}

    def counted(*args):
        calls["n"] += 1
        return fused_experts_triton(*args)

    if device == "cuda":
        assert ops.impl_for(torch.device("cuda")) is fused_experts_triton, "CUDA does not default to the Triton kernel"
        modes = {mode: (kwargs, True) for mode, kwargs in MODES.items()}
    else:  # the reference (CPU's default), then the Triton kernel under the interpreter
        modes = {"eager": (dict(enforce_eager=True), False), "eager+triton": (dict(enforce_eager=True), True)}
    failures = 0
    rows = []
    root = Path(tempfile.mkdtemp())
    prompts = random_prompts(6, seed=2, low=3, high=40)
    try:
        for family in MOE_FAMILIES:
            path = write_checkpoint(root / family, family, seed=1)
            expected = hf_greedy(path, prompts, 24)
            for mode, (kwargs, triton_serves) in modes.items():
                ops.register_impl(device, counted if triton_serves else None)
                calls["n"] = 0
                llm = LLM(str(path), dtype="float32", max_model_len=128, device=device, **kwargs)
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                    SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
                got = [o.outputs[0].token_ids for o in outs]
                stats = llm.engine.stats()
                ok = got == expected and (calls["n"] > 0) == triton_serves
                failures += not ok
                row = {"family": family, "mode": mode, "match": got == expected, "triton_moe_calls": calls["n"],
                       "graphs": stats.get("graphs")}
                rows.append(row)
                print(json.dumps(row), flush=True)
                del llm
                if device == "cuda":
                    torch.cuda.empty_cache()
    finally:
        ops.register_impl(device, None)
    report["parity"] = rows
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-parity", action="store_true", help="the kernel checks only")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no CUDA device: run with --device cpu (the Triton interpreter, tiny shapes)")
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    failures = kernel_checks(device, report)
    if not args.skip_parity:
        failures += parity_checks(device, report)
    report["failures"] = failures
    print(json.dumps({"failures": failures}))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
