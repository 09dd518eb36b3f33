"""The CPU tier on a GPU (part of recipes/gpu_check.sh): a round trip through pinned host memory with
the same greedy tokens, and the host-device bandwidth of block loads and saves.

A seeded random Llama (written with save_pretrained) generates for prompts that share long prefixes
three times: plain; with a device KV cache too small for the working set and a CPU tier (evicted
blocks go to pinned host memory and come back on a prefix hit); and with swap preemption. Tokens must
equal the plain run's, and the CPU tier must have been hit. Then the worker side alone copies blocks
device -> host and host -> device and reports GB/s.

    python recipes/gpu_kv_tier_check.py --out /tmp/gpu_check/kv_tiers.json     # --device cpu runs it here
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--blocks", type=int, default=256, help="blocks per bandwidth measurement")
    args = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.attention.kv_transfer import TieredKVWorker, run_transfers
    from toolkit.scheduling.kv_transfer import BlockCopy, KVTransferPlan
    from toolkit import LLM, SamplingParams

    small = args.device == "cpu"
    config = dict(MODEL, hidden_size=256, intermediate_size=512, num_hidden_layers=2) if small else MODEL
    report = {"device": args.device, "model": config}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16).save_pretrained(tmp)
        g = torch.Generator().manual_seed(1)
        prefixes = [torch.randint(3, 32000, (512,), generator=g).tolist() for _ in range(4)]
        prompts = [{"prompt_token_ids": prefixes[i % 4] + torch.randint(3, 32000, (16,), generator=g).tolist()}
                   for i in range(16)]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2  # bf16
        # Two prompts (33 blocks each) and one block more: both start, and the first to need a 34th
        # block preempts the other; the first eight prompts' blocks are evicted by the last eight.
        tight = dict(kv_cache_memory_bytes=67 * 16 * per_token, max_num_seqs=2)

        def run(**kwargs):
            llm = LLM(tmp, dtype="bfloat16", device=args.device, max_model_len=1024, **kwargs)
            first = llm.generate(prompts[:8], params, use_tqdm=False)
            second = llm.generate(prompts, params, use_tqdm=False)  # the first eight again, and eight more
            return [o.outputs[0].token_ids for o in first + second], llm.engine.stats()

        plain, _ = run()
        tier, tier_stats = run(kv_offloading_size=1, **tight)
        swap, swap_stats = run(kv_offloading_size=1, preemption_mode="swap", enable_prefix_caching=False, **tight)
        report["cpu_tier_tokens_equal"] = tier == plain
        report["swap_tokens_equal"] = swap == plain
        report["cpu_tier"] = tier_stats["kv_tiers"]
        report["swap"] = swap_stats["kv_tiers"]
        assert tier == plain, "tokens with the CPU tier differ from the plain run's"
        assert swap == plain, "tokens with swap preemption differ from the plain run's"
        assert tier_stats["kv_tiers"]["hit_blocks"]["cpu"] > 0, "the CPU tier was never hit"
        assert swap_stats["kv_tiers"]["swapped_in"] > 0, "no request was swapped out and back"

        llm = LLM(tmp, dtype="bfloat16", device=args.device, max_model_len=1024,
                  kv_cache_memory_bytes=(args.blocks + 8) * 16 * per_token)
        caches = llm.engine.runner.kv_caches
        worker = TieredKVWorker(caches, cpu_blocks=args.blocks)
        block_bytes = sum(c[:, 0].numel() * c.element_size() for c in caches)
        copies = [BlockCopy(b, "cpu", f"b{b}", b) for b in range(args.blocks)]
        bandwidth = {}
        for name, plan in (("device_to_host", KVTransferPlan(saves=copies)), ("host_to_device", KVTransferPlan(loads=copies))):
            times = []
            for _ in range(5):
                sync(args.device)
                start = time.perf_counter()
                run_transfers(worker, plan, len(caches))
                sync(args.device)
                times.append(time.perf_counter() - start)
            bandwidth[name] = {"gb_per_s": args.blocks * block_bytes / min(times) / 1e9, "best_s": min(times)}
        report["block_bytes"] = block_bytes
        report["bandwidth"] = bandwidth
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
