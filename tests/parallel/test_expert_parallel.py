"""Expert parallelism (and tensor-parallel experts) under real torchrun launches with gloo on CPU.

The oracle: the single-process greedy tokens, which equal transformers' own (checked here too), on
Mixtral (every layer sparse) and Qwen2-MoE (a gated shared expert, one dense layer), and on a Mixtral
whose routers were zeroed so every token of every layer goes to the same two experts (6 and 5:
torch.topk's pick among ties), i.e. to one rank at EP 2 and to two of four at EP 4, while the
other ranks receive nothing.

Launches (each checks several things, to keep the file short on 2 cores):
- the dispatcher alone on random tensors, 4 ranks as 2 replicas x tp 2 (tests/parallel/ep_worker.py);
- tp=2 with EP (eager), tp=2 with tensor-parallel experts (compiled), dp=2 with EP (compiled, the
  replicas' steps made uneven so one runs dummy forwards), tp2 x dp2 with EP (4 processes);
- a number of experts the EP size does not divide fails before any weight is read.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.checkpoints import hf_greedy, write_checkpoint
from tests.parallel.test_parallel import (COMPILE_BACKEND, LAUNCH_TIMEOUT_S, REPO, output_tail, read_reports,
                                         single_process, torchrun, worker_env)
from toolkit.parallel import ParallelConfigError
from toolkit.parallel.expert_parallel import check_expert_parallel, expert_range, tp_expert_slice

pytestmark = pytest.mark.slow

MODELS = ("mixtral", "qwen2_moe", "skewed")
NEW_TOKENS = 12
NUM_EXPERTS = 8
EP_WORKER = REPO / "tests" / "parallel" / "ep_worker.py"
# Lengths chosen so that dp=2's token-balanced split gives replica 0 the long prompt alone and
# replica 1 the three short ones: with an 8-token step budget their step counts differ.
PROMPT_LENGTHS = (29, 3, 4, 5)
UNEVEN_STEPS = {"max_num_batched_tokens": 8}


def write_skewed(source: Path, path: Path) -> Path:
    """A copy of `source` whose routers are all zero: uniform probabilities, the same top-2 for every token."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, path)
    tensors = load_file(path / "model.safetensors")
    for name in tensors:
        if name.endswith("block_sparse_moe.gate.weight"):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_parallel")
    paths = {family: write_checkpoint(root / family, family, seed=1) for family in ("mixtral", "qwen2_moe")}
    paths["skewed"] = write_skewed(paths["mixtral"], root / "skewed")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    prompts_file = root / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    expected, counts = {}, {}
    for name, path in paths.items():
        expected[name], llm = single_process(path, prompts, NEW_TOKENS)
        counts[name] = [m.tokens_per_expert.tolist() for m in llm.engine.runner.model.modules()
                        if type(m).__name__ == "Experts"]
        del llm
    return SimpleNamespace(root=root, paths=paths, prompts=prompts, prompts_file=prompts_file, expected=expected,
                           counts=counts)


def moe_args(moe, names) -> list[str]:
    args = [arg for name in names for arg in ("--model", str(moe.paths[name]))]
    return [*args, "--prompts", str(moe.prompts_file), "--max-tokens", str(NEW_TOKENS)]


def launch(moe, out: Path, nproc: int, names, *args: str):
    proc = torchrun(out, [f"--nproc-per-node={nproc}", "--standalone"], [*moe_args(moe, names), *args])
    assert proc.returncode == 0, output_tail(proc)
    return read_reports(out, nproc)


def check_tokens(moe, reports, names) -> None:
    for name, result in zip(names, reports[0]["models"]):
        assert result["tokens"] == moe.expected[name], name
    for report in reports[1:]:
        assert all(m["tokens"] == [] for m in report["models"]), "only global rank 0 returns outputs"


def check_expert_split(reports, ep: int) -> None:
    """Each rank holds exactly its contiguous 1/ep of every layer's experts, and counts only theirs."""
    for report in reports:
        for result in report["models"]:
            w13, w2 = result["expert_shapes"][0]
            assert w13[0] == w2[0] == NUM_EXPERTS // ep, result["model"]
            layers = len(result["first_expert"])
            full = layers * NUM_EXPERTS * (w13[1] * w13[2] + w2[1] * w2[2])
            assert result["expert_params"] * ep == full
            mine = expert_range(NUM_EXPERTS, report["rank"], ep)
            assert result["first_expert"] == [mine.start] * layers
            assert result["expert_parallel"]["experts"] == [mine.start, mine.stop]
            for counts in result["tokens_per_expert"]:
                assert not any(n for e, n in enumerate(counts) if e not in mine), (report["rank"], counts)


def check_skew(moe, reports, names) -> None:
    """The zeroed routers sent every pair to experts 5 and 6 (ranks owning others computed nothing)."""
    result_index = names.index("skewed")
    assert all(set(i for i, n in enumerate(c) if n) == {5, 6} for c in moe.counts["skewed"])
    ranks_with_work = {r["rank"] for r in reports if r["models"][result_index]["expert_parallel"]["rows_received"]}
    owners = {rank for rank in range(len(reports)) if {5, 6} & set(expert_range(NUM_EXPERTS, rank, len(reports)))}
    assert ranks_with_work == owners


# --- the dispatcher alone ----------------------------------------------------------------------------


def test_dispatcher_matches_single_process_reference_on_random_tensors(tmp_path):
    """4 ranks = 2 replicas x tp 2: uneven token counts (each TP rank dispatches its chunk), every
    pair to one rank ("skewed"/"last_rank"), a replica with no tokens ("empty"); eager and compiled
    (torch.compile fullgraph through toolkit::ep_moe) agree; per-rank expert counts sum to the routing."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone",
                           str(EP_WORKER), "--out", str(tmp_path), "--tp", "2"],
                          cwd=REPO, env=worker_env(None), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, output_tail(proc)
    reports = read_reports(tmp_path, 4)
    for report in reports:
        for case, result in report["cases"].items():
            assert result["max_diff"] < 1e-5, (report["rank"], case, result)
            assert result["compiled_equal"] and result["shape_ok"], (report["rank"], case)
        assert report["counts_match"] and report["local_counts_only"], report["rank"]
    # "last_rank": every pair to experts 6 and 7, rank 3's: no other rank computes anything.
    assert [r["cases"]["last_rank"]["received"] > 0 for r in reports] == [False, False, False, True]
    assert all(r["stats"]["dispatch_bytes"] > 0 and r["stats"]["combine_bytes"] > 0 for r in reports)


# --- the models ----------------------------------------------------------------------------------------


def test_single_process_equals_transformers(moe):
    for name in MODELS:
        assert moe.expected[name] == hf_greedy(moe.paths[name], moe.prompts, NEW_TOKENS), name


def test_tp2_with_expert_parallel(moe, tmp_path):
    reports = launch(moe, tmp_path, 2, MODELS, "--tp", "2",
                     "--engine-args", json.dumps({"enable_expert_parallel": True}))
    check_tokens(moe, reports, MODELS)
    check_expert_split(reports, ep=2)
    check_skew(moe, reports, MODELS)


def test_tp2_tensor_parallel_experts_compiled(moe, tmp_path):
    """Without EP: every rank holds all 8 experts, each with half of I (w13's gate and up rows, w2's columns)."""
    names = ("mixtral", "qwen2_moe")
    reports = launch(moe, tmp_path, 2, names, "--tp", "2", "--compile", COMPILE_BACKEND)
    check_tokens(moe, reports, names)
    for report in reports:
        for result in report["models"]:
            (w13, w2), = result["expert_shapes"]
            assert w13 == [NUM_EXPERTS, 32, 64] and w2 == [NUM_EXPERTS, 64, 16], result["model"]  # I = 32 split 2 ways
            assert result["compiled_graphs"] == 1
            assert result["expert_parallel"] is None
    # Both TP ranks route every token: each counts all of its replica's pairs.
    assert reports[0]["models"][0]["tokens_per_expert"] == reports[1]["models"][0]["tokens_per_expert"]


def test_dp2_with_expert_parallel_steps_in_lockstep(moe, tmp_path):
    """Compiled; the replicas' step counts differ (one long prompt against three short ones, 8-token steps),
    so the replica that finishes first runs dummy forwards until the other is done. A third engine gets
    one prompt: replica 1 has no request at all and runs nothing but dummy forwards."""
    names = ("mixtral", "skewed")
    one_prompt = tmp_path / "one_prompt.json"
    one_prompt.write_text(json.dumps(moe.prompts[:1]))
    reports = launch(moe, tmp_path, 2, (*names, "mixtral"), "--prompts", str(moe.prompts_file), "--prompts",
                     str(one_prompt), "--dp", "2",
                     "--compile", COMPILE_BACKEND, "--engine-args",
                     json.dumps({"enable_expert_parallel": True, **UNEVEN_STEPS}))
    check_tokens(moe, reports, names)
    assert reports[0]["models"][2]["tokens"] == moe.expected["mixtral"][:1]
    check_expert_split(reports, ep=2)
    check_skew(moe, reports, names)
    for i in range(len(names) + 1):
        ep = [r["models"][i]["expert_parallel"] for r in reports]
        assert ep[0]["lockstep_steps"] == ep[1]["lockstep_steps"]
        assert ep[0]["calls"] == ep[1]["calls"], "every rank entered every layer's all-to-all alike"
        assert ep[0]["dummy_steps"] == 0 < ep[1]["dummy_steps"], ep
    # Replica 1 of the one-prompt engine: a dummy forward for every step but the final agreement.
    solo = reports[1]["models"][2]["expert_parallel"]
    assert solo["dummy_steps"] == solo["lockstep_steps"] - 1
    assert all(m["compiled_graphs"] == 1 for r in reports for m in r["models"])


def test_tp2_x_dp2_with_expert_parallel(moe, tmp_path):
    reports = launch(moe, tmp_path, 4, MODELS, "--tp", "2", "--dp", "2",
                     "--engine-args", json.dumps({"enable_expert_parallel": True}))
    check_tokens(moe, reports, MODELS)
    check_expert_split(reports, ep=4)
    check_skew(moe, reports, MODELS)


def test_experts_not_divisible_by_ep_size_fail_before_loading(tmp_path, moe):
    path = write_checkpoint(tmp_path / "three_experts", "mixtral", num_local_experts=3)
    (path / "model.safetensors").unlink()  # a weight read would fail with a different error
    proc = torchrun(tmp_path, ["--nproc-per-node=2", "--standalone"],
                    ["--model", str(path), "--prompts", str(moe.prompts_file), "--dp", "2",
                     "--engine-args", json.dumps({"enable_expert_parallel": True})])
    assert proc.returncode != 0
    assert "expert parallel size 2 (tensor_parallel_size x data_parallel_size) does not divide the model's 3 experts" \
        in proc.stdout + proc.stderr


# --- in-process checks ---------------------------------------------------------------------------------


def test_expert_split_rules():
    check_expert_parallel(SimpleNamespace(num_experts=8, path="m"), 4)
    with pytest.raises(ParallelConfigError, match="does not divide the model's 8 experts.*1, 2, 4, 8"):
        check_expert_parallel(SimpleNamespace(num_experts=8, path="m"), 3)
    with pytest.raises(ParallelConfigError, match="needs a mixture-of-experts model"):
        check_expert_parallel(SimpleNamespace(moe=None, hf_config=None, path="m"), 2)
    assert [expert_range(8, r, 4) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # TP without EP: rank 1 of 2 reads rows 16-31 of an expert's gate/up [32, 64] and columns 16-31 of its down.
    assert tp_expert_slice("model.layers.0.block_sparse_moe.experts.3.w1.weight", (32, 64), 1, 2) == \
        (slice(16, 32), slice(0, 64))
    assert tp_expert_slice("model.layers.0.mlp.experts.3.down_proj.weight", (64, 32), 1, 2) == \
        (slice(0, 64), slice(16, 32))
    assert tp_expert_slice("model.layers.0.mlp.shared_expert.down_proj.weight", (64, 48), 1, 2) is None


def test_enable_expert_parallel_is_checked():
    from toolkit.config import EngineConfig

    with pytest.raises(ValueError, match="enable_expert_parallel must be a bool"):
        EngineConfig(model="m", enable_expert_parallel="yes")


def test_cli_dp2_with_expert_parallel_matches_single_process(moe, tmp_path):
    """`toolkit generate --dp 2 --enable-expert-parallel` (relaunched through torch.distributed.run):
    the replicas' shares of the input differ in length, the one that runs out of lines first keeps
    stepping (dummy forwards) until the other is done, and the records equal the single process's."""
    from tests.checkpoints import write_tokenizer
    from tests.cli.test_cli_parallel import FLAGS, by_line, run_cli

    model = write_tokenizer(Path(shutil.copytree(moe.paths["mixtral"], tmp_path / "model")))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(p + "\n" for p in [
        "a long line about lists, tuples, dictionaries and sets and how a program picks one of them",
        "hi", "the cat", "one two three"]))
    single, out = tmp_path / "single.jsonl", tmp_path / "out.jsonl"
    proc = run_cli("-m", model, "-i", prompts, "-o", single, *FLAGS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = run_cli("-m", model, "-i", prompts, "-o", out, *FLAGS, "--dp", 2, "--enable-expert-parallel",
                   "--max-num-batched-tokens", 8)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert by_line(out) == by_line(single)
