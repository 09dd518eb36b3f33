"""Batch-1 decode with and without speculative decoding, alternated in one process (an A/B that the
machine's drift moves alike), with the tokens checked identical.

    python recipes/spec_decode_ab.py --model toolkit/default_model/target \\
        --speculative-config '{"method": "draft_model", "num_speculative_tokens": 3}' \\
        --speculative-config '{"method": "draft_model", "num_speculative_tokens": 4}'

Without "model", a draft_model config uses the built-in draft (toolkit/default_model/draft).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

DEFAULT_DRAFT = Path(__file__).resolve().parent.parent / "toolkit" / "default_model" / "draft"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_DRAFT.parent / "target"))
    ap.add_argument("--speculative-config", action="append", required=True, metavar="JSON")
    ap.add_argument("--prompt", default="What is a list comprehension?")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    from toolkit import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    engines = {"plain": LLM(args.model, max_model_len=1024)}
    for text in args.speculative_config:
        spec = json.loads(text)
        if spec.get("method") == "draft_model":
            spec.setdefault("model", str(DEFAULT_DRAFT))
        engines[text] = LLM(args.model, max_model_len=1024, speculative_config=spec)
    expected = None
    for name, llm in engines.items():  # warm-up, and the tokens every engine must give
        tokens = llm.generate([args.prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        expected = expected or tokens
        assert tokens == expected, f"{name}: tokens differ from plain decoding"
    rates = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            start = time.perf_counter()
            llm.generate([args.prompt], params, use_tqdm=False)
            rates[name].append(args.tokens / (time.perf_counter() - start))
    plain = statistics.median(rates["plain"])
    for name, llm in engines.items():
        median = statistics.median(rates[name])
        spec = llm.engine.stats().get("spec_decode") or {}
        extra = (f", acceptance {spec['acceptance_rate']:.1%}, mean length {spec['mean_acceptance_length']:.2f}"
                 if spec.get("acceptance_rate") is not None else "")
        print(f"{name}: {median:.1f} tok/s median ({median / plain:.2f}x plain){extra}; "
              f"runs {[round(r) for r in rates[name]]}")


if __name__ == "__main__":
    main()
