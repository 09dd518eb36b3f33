"""A fresh process's engines on saved compiled steps: `python compiled_cache_worker.py CACHE_DIR SPEC_JSON`.

SPEC: {"models": [checkpoint, ...], "prompts": [[ids], ...], "max_tokens": n}. Prints one JSON line:
per model its greedy tokens and where its step came from, how many graphs Dynamo traced here, and how
many times Inductor ran the C++ compiler here (preprocessing a header to precompile it counts).
"""

import json
import sys
from pathlib import Path

from toolkit import compiled_cache

compiled_cache.cache_dir = lambda: Path(sys.argv[1])

from torch._dynamo.utils import counters  # noqa: E402
from torch._inductor import cpp_builder  # noqa: E402

builds = []
_build = cpp_builder.CppBuilder.build
cpp_builder.CppBuilder.build = lambda self: builds.append(self.get_target_file_path()) or _build(self)

from toolkit import LLM, SamplingParams  # noqa: E402

spec = json.loads(sys.argv[2])
results = []
for model in spec["models"]:
    llm = LLM(model, dtype="float32", max_model_len=96, compile_cache=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]],
                        SamplingParams(temperature=0, max_tokens=spec["max_tokens"]), use_tqdm=False)
    results.append({"tokens": [o.outputs[0].token_ids for o in outs],
                    "sources": llm.engine.runner.step.forward.sources})
    del llm
print(json.dumps({"models": results, "dynamo_graphs": counters["stats"]["unique_graphs"],
                  "cpp_builds": builds}))
