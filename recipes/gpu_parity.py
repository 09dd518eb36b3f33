"""GPU check: the engine on CUDA against transformers on the same weights (needs CUDA).

Seeded random checkpoints of every family the toolkit serves (tests/checkpoints.py), float32, greedy:
our tokens must equal transformers' on the GPU, eager, compiled, and compiled with CUDA-graph
decode steps; the compiled step must be one graph (two at most: CUDA graphs capture decode steps
per batch bucket on top of it). Prints one JSON line per case and exits non-zero on a mismatch.

    python recipes/gpu_parity.py
"""

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.checkpoints import FAMILIES, hf_greedy, random_prompts, write_checkpoint  # noqa: E402

MODES = {"eager": dict(enforce_eager=True), "compiled": dict(cuda_graphs=False), "compiled+cudagraphs": {}}


def main() -> int:
    import torch

    from toolkit import LLM, SamplingParams

    assert torch.cuda.is_available(), "this check needs a CUDA device"
    failures = 0
    root = Path(tempfile.mkdtemp())
    prompts = random_prompts(6, seed=2, low=3, high=40)
    for family in sorted(FAMILIES):
        path = write_checkpoint(root / family, family, seed=1)
        expected = hf_greedy(path, prompts, 24)
        for mode, kwargs in MODES.items():
            llm = LLM(str(path), dtype="float32", max_model_len=128, device="cuda", **kwargs)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
            got = [o.outputs[0].token_ids for o in outs]
            stats = llm.engine.stats()
            ok = got == expected and (mode == "eager" or stats["graphs"] <= 2)
            failures += not ok
            print(json.dumps({"family": family, "mode": mode, "match": got == expected, "graphs": stats["graphs"],
                              "attention": stats["attention_backend"], "model_changes": stats["model_changes"]}),
                  flush=True)
            del llm
            torch.cuda.empty_cache()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
