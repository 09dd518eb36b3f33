"""What a KV block costs to bring back from each tier, against computing it again.

    python recipes/kv_tier_timing.py --model-shape 125m --dtype bfloat16 --blocks 64

Recompute: the engine's compiled step prefilling `blocks` blocks of one prompt (after a warm-up that
compiles it), per block. CPU tier and disk tier: the worker side of the tiers
(attention/kv_transfer.py) saving and then loading the same number of blocks of that engine's KV
cache, per block; the disk figures include the checksum and the header checks, and the file system's
page cache (a second process soon after the first reads from memory, not the platter).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-shape", default="125m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from toolkit.attention.kv_transfer import TieredKVWorker, run_transfers
    from toolkit.cli.bench.model import resolve_model
    from toolkit.scheduling.kv_transfer import BlockCopy, KVTransferPlan
    from toolkit import LLM, SamplingParams

    path, load_format = resolve_model(None, args.model_shape, need_weights=False)
    tokens = args.blocks * 16 + 1
    llm = LLM(str(path), dtype=args.dtype, load_format=load_format, max_model_len=tokens + 16, skip_tokenizer_init=True,
              enable_prefix_caching=False, kv_cache_memory_bytes=None, max_num_batched_tokens=tokens)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = {"prompt_token_ids": [5 + i % 1000 for i in range(tokens)]}
    llm.generate([prompt], params, use_tqdm=False)  # compiles the step
    recompute = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        recompute.append((time.perf_counter() - start) / args.blocks)

    caches = llm.engine.runner.kv_caches
    blocks = list(range(args.blocks))
    with tempfile.TemporaryDirectory(prefix="kv-tier-timing-") as disk_dir:
        worker = TieredKVWorker(caches, cpu_blocks=args.blocks, disk_dir=disk_dir, fingerprint="timing")
        figures = {"recompute": recompute}
        for tier in ("cpu", "disk"):
            saves = KVTransferPlan(saves=[BlockCopy(b, tier, f"{tier}{b:04d}", b) for b in blocks])
            loads = KVTransferPlan(loads=[BlockCopy(b, tier, f"{tier}{b:04d}", b) for b in blocks])
            save_s, load_s = [], []
            for _ in range(args.rounds):
                start = time.perf_counter()
                run_transfers(worker, saves, len(caches))
                if tier == "disk":
                    worker.close()  # the writes themselves, not just handing them to the writer thread
                    worker = TieredKVWorker(caches, cpu_blocks=args.blocks, disk_dir=disk_dir, fingerprint="timing")
                save_s.append((time.perf_counter() - start) / args.blocks)
                start = time.perf_counter()
                failed = run_transfers(worker, loads, len(caches))
                load_s.append((time.perf_counter() - start) / args.blocks)
                assert not failed, failed
            figures[f"save to {tier}"], figures[f"load from {tier}"] = save_s, load_s
        worker.close()
    block_bytes = sum(c[:, 0].numel() * c.element_size() for c in caches)
    print(f"{args.model_shape} {args.dtype}: one block = 16 tokens = {block_bytes / 2**10:.0f} KiB of KV; "
          f"median of {args.rounds} rounds of {args.blocks} blocks")
    base = statistics.median(recompute)
    for name, values in figures.items():
        ms = statistics.median(values) * 1e3
        print(f"  {name:16s} {ms:8.3f} ms/block  ({ms / (base * 1e3):.3f}x recompute)")


if __name__ == "__main__":
    main()
