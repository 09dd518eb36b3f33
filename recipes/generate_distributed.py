"""Offline generation with tensor and/or data parallelism: the driver behind recipes/run_*.sh.

Every rank runs this same program (SPMD): each builds `LLM(..., tensor_parallel_size=TP,
data_parallel_size=DP)` and calls `generate` with the same prompts. Global rank 0 gets all the
outputs (in input order) and prints them / writes them as JSON lines; every other rank gets [].

    torchrun --standalone --nproc-per-node 2 recipes/generate_distributed.py --tp 2
    python recipes/generate_distributed.py --tp 2 --dp 2   # relaunches itself through torch.distributed.run

The model defaults to the tiny demo model (toolkit/default_model/target: 6 heads, 2 kv heads, so
TP 2 splits it), which shows the parallel machinery in seconds; the CLI's default, SmolLM2-135M-Instruct,
is --model PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf (9 heads, 3 kv heads: TP 1 or 3).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from toolkit.parallel import is_main_process, maybe_relaunch, shutdown  # noqa: E402


def main() -> None:
    args = parse_args()
    code = maybe_relaunch(args.tp * args.dp)  # outside torchrun: start tp*dp copies of this command
    if code is not None:
        sys.exit(code)
    from toolkit import LLM, SamplingParams  # only in the processes that do the work (slow import)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    llm = LLM(
        str(args.model or default_model()), tensor_parallel_size=args.tp, data_parallel_size=args.dp,
        dtype=args.dtype, enforce_eager=args.eager, max_model_len=args.max_model_len,
    )
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    prompts = read_prompts(args.prompts)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    if is_main_process():
        write_outputs(prompts, outputs, args.output)
    shutdown()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="Hugging Face model folder (default: the built-in model)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (processes per model replica)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (model replicas)")
    p.add_argument("--prompts", type=Path, default=REPO / "recipes" / "example_prompts.txt", help="one prompt per line")
    p.add_argument("--output", type=Path, help="JSON lines written by rank 0 (default: print)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--eager", action="store_true", help="skip torch.compile (faster start on CPU)")
    p.add_argument("--chat", action="store_true", help="each prompt is a user message, through the chat template")
    return p.parse_args()


def default_model() -> Path:
    from toolkit.cli.default_model import DEMO_MODEL

    return DEMO_MODEL


def read_prompts(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


def write_outputs(prompts: list[str], outputs, path: Path | None) -> None:
    lines = [json.dumps({"prompt": p, "text": o.outputs[0].text, "token_ids": o.outputs[0].token_ids})
             for p, o in zip(prompts, outputs)]
    if path is None:
        print("\n".join(lines))
    else:
        path.write_text("\n".join(lines) + "\n")
        print(f"wrote {len(lines)} outputs to {path}")


if __name__ == "__main__":
    main()
