"""Pipeline parallelism against the single-process run, under real torchrun launches (gloo on CPU).

The oracle: the single process's greedy tokens, which equal transformers' (checked once in the
fixture), for two families (llama3: GQA and RoPE scaling; tied_mqa: tied embeddings, which both
ends of the pipeline hold, and one kv head) on 5 layers, which no stage count here divides evenly.
Each launch checks several things at once, since every launch starts 3-4 processes on 2 cores:

- pp=3 (stages of 2, 2 and 1 layers), the shipped Inductor compile, with chunked prefill and
  preemption both forced: the tokens; each stage's parameters are exactly its layers' (and the
  embedding on the first, the norm and lm_head on the last) with the single process's bytes; its
  KV cache holds its layers only; several plans were in flight; every rank preempted alike.
- pp=2 x tp=2 (compiled through DTensor): the tokens, and each rank's KV holds its stage's layers
  and its TP share of the kv heads.
- pp=2 x dp=2 with an explicit partition ("1,4") and preemption forced: the tokens, gathered on
  rank 0 only; and seeded sampling (n=2) with logprobs and prompt logprobs, which travel back from
  the last stage with the tokens: the single process's tokens, and its logprobs within 1e-4; the
  results' first message cut to 512 bytes, so long ones (logprobs) also take the second message.
- a stage that dies or hangs mid-run ends the job (a hang within the collective timeout), with the
  waiting rank's error naming the other one.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.checkpoints import hf_greedy, random_prompts, write_checkpoint
from tests.parallel.test_parallel import (COMPILE_BACKEND, output_tail, param_bytes, read_reports, single_process,
                                         torchrun)
from tests.parallel.worker import sampled_report
from toolkit import SamplingParams

pytestmark = pytest.mark.slow

FAMILIES = ("llama3", "tied_mqa")
NUM_LAYERS, NUM_PROMPTS, NEW_TOKENS = 5, 8, 10
# Bytes of 4 KV blocks (16 tokens) of a 2-layer stage of llama3 (2 kv heads x 16 dims, float32): 8 prompts
# of up to 30 tokens plus 10 new ones cannot all fit, so requests are preempted and recompute.
SQUEEZED_KV = 4 * 16 * 2 * 2 * 2 * 16 * 4
CHUNKED = 16  # max_num_batched_tokens: most prompts are prefilled in several chunks
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=7, n=2, logprobs=2, prompt_logprobs=1, max_tokens=6)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    paths = {f: write_checkpoint(root / f, f, seed=1, num_hidden_layers=NUM_LAYERS) for f in FAMILIES}
    prompts = random_prompts(NUM_PROMPTS, seed=5, low=3, high=30)
    prompts_file = root / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    expected, params, sampled = {}, {}, {}
    for family, path in paths.items():
        expected[family], llm = single_process(path, prompts, NEW_TOKENS)
        assert expected[family] == hf_greedy(path, prompts, NEW_TOKENS), family
        params[family] = param_bytes(llm)
        sampled[family] = [sampled_report(o) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(**SAMPLED), use_tqdm=False)]
    return SimpleNamespace(paths=paths, prompts=prompts_file, expected=expected, param_bytes=params, sampled=sampled)


def worker_args(case, *flags: str, engine_args: dict | None = None) -> list[str]:
    models = [arg for family in FAMILIES for arg in ("--model", str(case.paths[family]))]
    return [*models, "--prompts", str(case.prompts), "--max-tokens", str(NEW_TOKENS), *flags,
            "--engine-args", json.dumps({"cpu_linear": "torch", **(engine_args or {})})]


def stage_tensors(param_bytes: dict[str, int], layers: range, first: bool, last: bool) -> dict[str, int]:
    """The parameters (name: bytes) a stage must hold: its layers', plus the embedding on the first
    stage and the norm and lm_head on the last. `param_bytes` is the single process's; with tied
    embeddings it names the shared tensor once, as the embedding, which a last stage holds as lm_head."""
    held = {n: b for n, b in param_bytes.items() if n.startswith("model.layers.") and int(n.split(".")[2]) in layers}
    if first:
        held["model.embed_tokens.weight"] = param_bytes["model.embed_tokens.weight"]
    if last:
        held["model.norm.weight"] = param_bytes["model.norm.weight"]
        held["lm_head.weight"] = param_bytes.get("lm_head.weight", param_bytes["model.embed_tokens.weight"])
    return held


def test_pp3_uneven_compiled_matches_single_process_with_chunked_prefill_and_preemption(case, tmp_path):
    proc = torchrun(tmp_path, ["--nproc-per-node=3", "--standalone"],
                    worker_args(case, "--pp", "3", "--compile", "inductor",
                                engine_args={"max_num_batched_tokens": CHUNKED, "kv_cache_memory_bytes": SQUEEZED_KV}))
    assert proc.returncode == 0, output_tail(proc)
    reports = read_reports(tmp_path, 3)
    stage_layers = [range(0, 2), range(2, 4), range(4, 5)]  # vLLM's rule: the leftovers before the last
    for i, family in enumerate(FAMILIES):
        assert reports[0]["models"][i]["tokens"] == case.expected[family], family
        preemptions = {r["models"][i]["preemptions"] for r in reports}
        assert len(preemptions) == 1 and preemptions.pop() > 0, "every rank's scheduler preempts alike"
        for stage, report in enumerate(reports):
            result = report["models"][i]
            held = stage_tensors(case.param_bytes[family], stage_layers[stage], stage == 0, stage == 2)
            assert result["param_names"] == sorted(held), (family, stage)
            assert result["param_bytes"] == sum(held.values()), (family, stage)
            assert result["kv_layers"] == len(stage_layers[stage]), (family, stage)
            pipeline = result["pipeline"]
            assert pipeline["stage"] == stage and pipeline["layers"] == [stage_layers[stage].start,
                                                                         stage_layers[stage].stop]
            assert pipeline["max_in_flight"] > 1, "several plans were in flight at once"
            assert result["compiled_graphs"] <= 2, result["compiled_graphs"]
        # The stages agree on one block count: the fullest stage's (2 layers) fits 4 blocks.
        assert {r["models"][i]["kv_shape"][1] for r in reports} == {4 if family == "llama3" else 8}


def test_pp2_x_tp2_matches_single_process(case, tmp_path):
    proc = torchrun(tmp_path, ["--nproc-per-node=4", "--standalone"],
                    worker_args(case, "--pp", "2", "--tp", "2", "--compile", COMPILE_BACKEND,
                                engine_args={"max_num_batched_tokens": CHUNKED}))
    assert proc.returncode == 0, output_tail(proc)
    reports = read_reports(tmp_path, 4)
    for i, family in enumerate(FAMILIES):
        assert reports[0]["models"][i]["tokens"] == case.expected[family], family
        for rank, report in enumerate(reports):  # ranks 0, 1: stage 1 (layers 0-2); 2, 3: stage 2 (3-4)
            result = report["models"][i]
            assert result["kv_layers"] == (3 if rank < 2 else 2), (family, rank)
            assert result["kv_shape"][3] == 1, "llama3's 2 kv heads over 2 ranks, MQA's one on each"
            assert result["pipeline"]["stage"] == rank // 2
        assert all(r["models"][i]["tokens"] == [] for r in reports[1:]), "only global rank 0 returns outputs"


def test_pp2_x_dp2_with_a_partition_matches_single_process(case, tmp_path):
    proc = torchrun(tmp_path, ["--nproc-per-node=4", "--standalone"],
                    worker_args(case, "--pp", "2", "--dp", "2", "--sampled", json.dumps(SAMPLED), "--result-head", "512",
                                engine_args={"pp_layer_partition": "1,4", "kv_cache_memory_bytes": 2 * SQUEEZED_KV}))
    assert proc.returncode == 0, output_tail(proc)
    reports = read_reports(tmp_path, 4)
    for i, family in enumerate(FAMILIES):
        assert reports[0]["models"][i]["tokens"] == case.expected[family], family
        assert all(r["models"][i]["tokens"] == [] for r in reports[1:]), "only global rank 0 returns outputs"
        assert [r["models"][i]["kv_layers"] for r in reports] == [1, 4, 1, 4]  # dp0: ranks 0-1, dp1: ranks 2-3
        assert_same_samples(reports[0]["models"][i]["sampled"], case.sampled[family])
    assert sum(r["models"][0]["preemptions"] for r in reports) > 0
    # With a 512-byte first message, the results with logprobs took the second message (rank 1 and 3
    # are the last stages, the result sources), and short ones did not: both paths gave the tokens above.
    sources = [r["models"][i]["pipeline"] for r in reports[1::2] for i in range(len(FAMILIES))]
    assert all(0 < p["long_results"] < p["plans"] for p in sources), sources


def assert_same_samples(got: list[dict], want: list[dict]) -> None:
    """The same tokens per sequence; the same logprob entries (token ids exact, values within 1e-4)."""
    assert [[o["tokens"] for o in r["outputs"]] for r in got] == [[o["tokens"] for o in r["outputs"]] for r in want]
    pairs = [(g, w) for rg, rw in zip(got, want) for og, ow in zip(rg["outputs"], rw["outputs"])
             for g, w in zip(og["logprobs"], ow["logprobs"])]
    pairs += [(g, w) for rg, rw in zip(got, want) for g, w in zip(rg["prompt_logprobs"], rw["prompt_logprobs"])]
    assert len(pairs) > NUM_PROMPTS
    for g, w in pairs:
        assert (g is None) == (w is None)
        if g is not None:
            assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-4 for t in g), (g, w)


def test_a_stage_dying_mid_run_ends_the_job_naming_it(case, tmp_path):
    start = time.monotonic()
    # The agent stops the surviving rank at its first poll after a death (every 0.1 s by default), which
    # on a loaded machine can come before that rank has had a time slice to notice and name its peer
    # (it once did): polling every 2 s leaves it that moment, and the job still ends within seconds.
    proc = torchrun(tmp_path, ["--nproc-per-node=2", "--standalone", "--monitor-interval=2"],
                    ["--model", str(case.paths["llama3"]), "--prompts", str(case.prompts), "--pp", "2",
                     "--fail-rank", "1"],
                    env={"TOOLKIT_DIST_TIMEOUT": "20"})
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    # Rank 0 finds the death waiting for rank 1's tokens, or, where it was sending the next step's hidden
    # states when rank 1's connection closed, in that send: either way both ranks are named.
    assert re.search(r"pipeline stage 1 of 2 \(rank 0\) (stopped waiting for the last stage \(rank 1\)'s tokens"
                     r"|could not send its hidden states to stage 2 \(rank 1\))", proc.stdout + proc.stderr), \
        output_tail(proc)
    assert elapsed < 150, f"the job took {elapsed:.0f} s to fail"


def test_a_silent_stage_fails_the_job_after_the_timeout_naming_it(case, tmp_path):
    """The first stage hangs (alive, sockets open): the last stage, waiting for its hidden states, gives
    up after TOOLKIT_DIST_TIMEOUT and names it."""
    start = time.monotonic()
    proc = torchrun(tmp_path, ["--nproc-per-node=2", "--standalone"],
                    ["--model", str(case.paths["llama3"]), "--prompts", str(case.prompts), "--pp", "2",
                     "--fail-rank", "0", "--fail-mode", "hang"], env={"TOOLKIT_DIST_TIMEOUT": "10"})
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "pipeline stage 2 of 2 (rank 1) stopped waiting for stage 1 (rank 0)'s hidden states" in (
        proc.stdout + proc.stderr), output_tail(proc)
    assert elapsed < 150, f"the job took {elapsed:.0f} s to fail"
