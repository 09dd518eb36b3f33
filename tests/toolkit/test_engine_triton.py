"""The engine with the Triton attention backend gives the torch backend's greedy tokens.

On CPU the kernels run under TRITON_INTERPRET=1, which must be set before triton is first
imported, so the comparison runs in a fresh interpreter process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.checkpoints import random_prompts, write_checkpoint

SCRIPT = textwrap.dedent("""
    import json, sys
    from toolkit import LLM, SamplingParams
    path, prompts = sys.argv[1], json.loads(sys.argv[2])
    result = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=64, attention_backend=backend,
                  max_num_batched_tokens=16)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        result[backend] = [o.outputs[0].token_ids for o in outs]
    print(json.dumps(result))
""")


def test_triton_backend_matches_torch_backend_end_to_end(tmp_path):
    path = write_checkpoint(tmp_path / "m", "llama3", seed=4, num_hidden_layers=1)
    # Mixed lengths and a 16-token budget: chunked prefills and decodes share steps.
    prompts = random_prompts(3, seed=9, low=2, high=20)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path), json.dumps(prompts)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["triton"] == result["torch"]
    assert all(len(t) == 6 for t in result["torch"])
