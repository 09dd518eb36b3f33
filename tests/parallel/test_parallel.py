"""Parallel modes against the single-process run, under real torchrun launches with gloo on CPU.

The oracle: tensor parallel (tp=2, over two torchrun agents on 127.0.0.1 acting as two nodes),
data parallel (dp=2, the recipe driver relaunching itself), both (dp=2 x tp=2, 4 processes) and
compiled tp=2 engines built one after another in one process all give exactly the greedy tokens of one process, on llama3 (GQA 4:2, kv heads
split) and tied_mqa (1 kv head, replicated at tp=2; tied embeddings through the vocab-parallel
embedding). Bad configurations fail the whole job with a clear message, and a rank that dies or
hangs mid-run ends the job, never hangs it.

Every launch is `python -m torch.distributed.run ... tests/parallel/worker.py`; each rank
writes a JSON report the test reads. Kept small (tiny checkpoints, 4 prompts, 12 tokens, few
launches) because every launch starts 2-4 Python processes on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from toolkit.parallel import ParallelConfigError, split_by_tokens
from toolkit.parallel.distributed import check_sizes
from toolkit.parallel.tensor_parallel import check_tensor_parallel
from tests.checkpoints import random_prompts, write_checkpoint, write_tokenizer
from toolkit import LLM, SamplingParams

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "parallel" / "worker.py"
FAMILIES = ("llama3", "tied_mqa")
NUM_PROMPTS, NEW_TOKENS = 4, 12
LAUNCH_TIMEOUT_S = 300  # far above a healthy launch (~20-100 s): reaching it means a hang
# "aot_eager": the runner's torch.compile(fullgraph=True, dynamic=True) traces the DTensor model
# into one graph and AOTAutograd desugars DTensor into plain ops and functional collectives; only
# Inductor's code generation is left out, which would add ~50 s to this file on 2 cores. "inductor"
# (what the runner ships) gives the same tokens: set it here to check that.
COMPILE_BACKEND = "aot_eager"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    paths = {family: write_checkpoint(root / family, family, seed=1) for family in FAMILIES}
    prompts = random_prompts(NUM_PROMPTS, seed=3, low=3, high=30)
    prompts_file = root / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    expected, params = {}, {}
    for family, path in paths.items():
        expected[family], llm = single_process(path, prompts, NEW_TOKENS)
        params[family] = param_bytes(llm)
    return SimpleNamespace(root=root, paths=paths, prompts=prompts_file, expected=expected, param_bytes=params)


@pytest.fixture(scope="module")
def two_node_tp2(case, tmp_path_factory):
    """tp=2 over two torchrun agents (one process each) meeting on 127.0.0.1 as two nodes: the eager
    tp=2 run that several tests read (the compiled and dp x tp runs are single-agent launches)."""
    out = tmp_path_factory.mktemp("two_node_tp2")
    procs = launch_two_nodes(out, [*model_args(case, FAMILIES), "--tp", "2"])
    for node, proc in enumerate(procs):
        assert proc.returncode == 0, f"node {node}: {output_tail(proc)}"
    return read_reports(out, 2)


# --- the parallel modes give the single-process tokens -------------------------------------------


def test_tp2_across_two_nodes_matches_single_process(case, two_node_tp2):
    for family, result in zip(FAMILIES, two_node_tp2[0]["models"]):
        assert result["tokens"] == case.expected[family], family
    assert all(m["tokens"] == [] for m in two_node_tp2[1]["models"]), "only global rank 0 returns outputs"


def test_tp2_kv_cache_holds_local_kv_heads(two_node_tp2):
    # llama3: 2 kv heads split 1 per rank; tied_mqa: its 1 kv head replicated on both ranks.
    for report in two_node_tp2:
        for result in report["models"]:
            assert result["kv_shape"][3] == 1, result


def test_tp2_resident_weight_bytes_are_half_the_sharded_ones(case, two_node_tp2):
    params = case.param_bytes["llama3"]
    replicated = sum(b for name, b in params.items() if name.endswith("norm.weight"))
    sharded = sum(params.values()) - replicated
    for report in two_node_tp2:
        assert report["models"][0]["param_bytes"] == sharded // 2 + replicated, report["rank"]


def test_dp2_x_tp2_matches_single_process(case, tmp_path):
    """Also with the KV hierarchy squeezed: a 3-block device cache (preemption, evictions), a CPU tier
    and a disk tier both replicas share; every TP rank moves its own shard of each block."""
    tiers = {"kv_cache_memory_bytes": 3 * 16 * 256, "kv_offloading_size": 0.01,
             "kv_disk_cache_dir": str(tmp_path / "kv")}
    proc = torchrun(tmp_path, ["--nproc-per-node=4", "--standalone"],
                    [*model_args(case, FAMILIES), "--tp", "2", "--dp", "2", "--engine-args", json.dumps(tiers)])
    assert proc.returncode == 0, output_tail(proc)
    reports = read_reports(tmp_path, 4)
    for family, result in zip(FAMILIES, reports[0]["models"]):
        assert result["tokens"] == case.expected[family], family
    for report in reports[1:]:
        assert all(m["tokens"] == [] for m in report["models"]), "only global rank 0 returns outputs"
    moved = [sum(m["kv_tiers"]["copied_blocks"].values()) for r in reports for m in r["models"]]
    assert all(n > 0 for n in moved), moved
    # Each TP rank writes its own shard's entries, under its own fingerprint.
    assert len([d for d in (tmp_path / "kv").iterdir() if d.is_dir()]) == 2 * len(FAMILIES)


def test_recipe_driver_relaunches_itself_as_dp2(case, tmp_path):
    """recipes/generate_distributed.py started as one plain process with --dp 2 re-runs itself as 2
    processes through torch.distributed.run (parallel.launch); rank 0 writes the outputs in order."""
    model = Path(shutil.copytree(case.paths["llama3"], tmp_path / "model"))
    write_tokenizer(model)
    texts = ["the cat sat on the mat", "a list comprehension builds a list from an iterable", "hello world",
             "python functions return values; a generator yields them one at a time"]
    (tmp_path / "prompts.txt").write_text("\n".join(texts) + "\n")
    llm = LLM(str(model), dtype="float32", enforce_eager=True, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    expected = [o.outputs[0].token_ids for o in llm.generate(texts, params, use_tqdm=False)]
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "recipes/generate_distributed.py", "--model", str(model), "--dp", "2", "--eager",
         "--prompts", str(tmp_path / "prompts.txt"), "--output", str(out), "--max-tokens", str(NEW_TOKENS),
         "--max-model-len", "128"],
        cwd=REPO, env=worker_env(None), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
    )
    assert proc.returncode == 0, output_tail(proc)
    assert [json.loads(line)["token_ids"] for line in out.read_text().splitlines()] == expected


def test_tp2_compiled_builds_model_after_model_in_one_process(case, tmp_path):
    """Compiled tp=2, six engines in turn in each rank's process (a notebook, a sweep): each gives the
    single-process tokens, each compiles its own step once, and none runs into Dynamo's recompile
    limit (this once failed at the fifth model)."""
    families = ("llama3", "tied_mqa") * 3
    proc = torchrun(tmp_path, ["--nproc-per-node=2", "--standalone"],
                    [*model_args(case, families), "--tp", "2", "--compile", COMPILE_BACKEND])
    assert proc.returncode == 0, output_tail(proc)
    reports = read_reports(tmp_path, 2)
    for family, result in zip(families, reports[0]["models"]):
        assert result["tokens"] == case.expected[family], family
    for report in reports:
        assert [m["compiled_graphs"] for m in report["models"]] == [1] * len(families), report["rank"]


def test_tp2_speculative_decoding_matches_single_process(case, tmp_path):
    """n-gram and draft-model speculation under tp=2 (the draft replicated on both ranks, drafts and
    verified tokens from TP rank 0): the single-process greedy tokens."""
    from tests.speculative.checkpoints import write_perturbed_draft

    draft = write_perturbed_draft(case.paths["llama3"], tmp_path / "draft")
    specs = [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
             {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
             {"method": "draft_model", "model": str(case.paths["tied_mqa"]), "num_speculative_tokens": 2}]
    families = ("llama3", "llama3", "tied_mqa")
    spec_args = [arg for spec in specs for arg in ("--speculative-config", json.dumps(spec))]
    proc = torchrun(tmp_path, ["--nproc-per-node=2", "--standalone"],
                    [*model_args(case, families), "--tp", "2", *spec_args])
    assert proc.returncode == 0, output_tail(proc)
    reports = read_reports(tmp_path, 2)
    for family, result in zip(families, reports[0]["models"]):
        assert result["tokens"] == case.expected[family], family
    for report in reports:
        stats = [m["spec_decode"] for m in report["models"]]
        assert all(s["num_drafts"] > 0 for s in stats), report["rank"]
        assert 0 < stats[1]["num_accepted_tokens"] < stats[1]["num_draft_tokens"], "a draft that is sometimes wrong"
        assert stats[2]["acceptance_rate"] == 1.0, "the target as its own draft"
    assert [m["spec_decode"] for m in reports[0]["models"]] == [m["spec_decode"] for m in reports[1]["models"]]


# --- bad configurations and failures end the job with a clear error -------------------------------


def test_tp_not_dividing_heads_fails_before_reading_weights(tmp_path, case):
    path = write_checkpoint(tmp_path / "three_heads", "llama3", hidden_size=48, num_attention_heads=3,
                            num_key_value_heads=1)
    (path / "model.safetensors").unlink()  # a weight read would fail with a different error
    proc = torchrun(tmp_path, ["--nproc-per-node=2", "--standalone"],
                    ["--model", str(path), "--prompts", str(case.prompts), "--tp", "2"])
    assert proc.returncode != 0
    assert "tensor_parallel_size 2 does not divide the model's 3 attention heads" in proc.stdout + proc.stderr


def test_missing_shard_file_on_one_rank_fails_the_job(tmp_path, case):
    full = split_into_shards(write_checkpoint(tmp_path / "sharded", "llama3", seed=1))
    shards = sorted(full.glob("model-*.safetensors"))
    broken = Path(shutil.copytree(full, tmp_path / "rank1_copy"))
    (broken / shards[-1].name).unlink()
    proc = torchrun(tmp_path, ["--nproc-per-node=2", "--standalone"],
                    ["--model", str(full), "--model-for-rank", f"1={broken}", "--prompts", str(case.prompts),
                     "--tp", "2"])
    assert proc.returncode != 0
    assert f"checkpoint shard missing: {broken / shards[-1].name}" in proc.stdout + proc.stderr


def test_rank_dying_mid_run_ends_both_nodes(tmp_path, case):
    """The rank on node 1 exits at its 4th step; node 0's rank, blocked in a collective, must fail too
    (no agent is shared between the nodes: the failure has to travel through the process group)."""
    start = time.monotonic()
    procs = launch_two_nodes(tmp_path, [*model_args(case, ("llama3",)), "--tp", "2", "--fail-rank", "1"],
                             env={"TOOLKIT_DIST_TIMEOUT": "20"})
    elapsed = time.monotonic() - start
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    assert elapsed < 150, f"the job took {elapsed:.0f} s to fail"


def test_silent_rank_fails_the_job_after_the_timeout(tmp_path, case):
    """A rank that hangs (alive, sockets open) is only noticed by the collective timeout."""
    start = time.monotonic()
    proc = torchrun(tmp_path, ["--nproc-per-node=2", "--standalone"],
                    [*model_args(case, ("llama3",)), "--tp", "2", "--fail-rank", "1", "--fail-mode", "hang"],
                    env={"TOOLKIT_DIST_TIMEOUT": "10"})
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "Timed out waiting 10000ms" in proc.stdout + proc.stderr
    assert elapsed < 150, f"the job took {elapsed:.0f} s to fail"


# --- in-process checks (no launch) ----------------------------------------------------------------


def test_split_by_tokens_balances_tokens_not_counts():
    # One long request weighs as much as five short ones.
    assert split_by_tokens([100, 20, 20, 20, 20, 20], 2) == [[0], [1, 2, 3, 4, 5]]
    shares = split_by_tokens([5, 7, 3, 9, 1, 4, 6], 3)
    assert sorted(i for share in shares for i in share) == list(range(7))
    assert all(share == sorted(share) for share in shares)  # each replica keeps input order
    assert split_by_tokens([3], 2) == [[0], []]  # a replica may get nothing


def test_tensor_parallel_size_is_checked_against_the_heads():
    gqa = SimpleNamespace(family="llama", num_heads=8, num_kv_heads=2, intermediate_size=64, path="m")
    for tp in (1, 2, 4, 8):  # 4 and 8: more ranks than kv heads, each kv head replicated
        check_tensor_parallel(gqa, tp)
    with pytest.raises(ParallelConfigError, match="3 does not divide the model's 8 attention heads.*1, 2, 4, 8"):
        check_tensor_parallel(gqa, 3)
    odd_kv = SimpleNamespace(family="llama", num_heads=12, num_kv_heads=4, intermediate_size=96, path="m")
    with pytest.raises(ParallelConfigError, match="cannot share the model's 4 kv heads"):
        check_tensor_parallel(odd_kv, 6)
    odd_mlp = SimpleNamespace(family="llama", num_heads=8, num_kv_heads=2, intermediate_size=161, path="m")
    with pytest.raises(ParallelConfigError, match="does not divide the model's intermediate size 161"):
        check_tensor_parallel(odd_mlp, 2)


def test_parallel_sizes_must_multiply_to_the_world_size():
    check_sizes(2, 2, 4)
    with pytest.raises(ParallelConfigError, match="2 x data_parallel_size 1 = 2 processes, but .* world size of 1"):
        check_sizes(2, 1, 1)
    with pytest.raises(ParallelConfigError, match="must be an integer >= 1"):
        check_sizes(0, 1, 1)
    check_sizes(2, 2, 8, pp=2)
    with pytest.raises(ParallelConfigError, match=r"data_parallel_size 1 x pipeline_parallel_size 3 = 6 processes, "
                                                  r"but .* world size of 4"):
        check_sizes(2, 1, 4, pp=3)


# --- helpers --------------------------------------------------------------------------------------


def split_into_shards(path: Path) -> Path:
    """Rewrite model.safetensors as two shard files and an index (the layout of large checkpoints)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in files.items():
        save_file({n: tensors[n] for n in part}, path / file, metadata={"format": "pt"})
    weight_map = {n: file for file, part in files.items() for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "model.safetensors").unlink()
    return path


def single_process(path: Path, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], LLM]:
    """The oracle run: one process, eager, with plain weights as on the parallel ranks (the same matmul
    kernels, and parameter bytes to compare); its greedy tokens per prompt, and the LLM."""
    llm = LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=128, block_size=16,
              skip_tokenizer_init=True, cpu_linear="torch")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def param_bytes(llm: LLM) -> dict[str, int]:
    """Each parameter's bytes by name (a tied tensor under its first name only)."""
    return {n: p.numel() * p.element_size() for n, p in llm.engine.runner.model.named_parameters()}


def model_args(case, families) -> list[str]:
    args = [arg for family in families for arg in ("--model", str(case.paths[family]))]
    return [*args, "--prompts", str(case.prompts), "--max-tokens", str(NEW_TOKENS)]


def torchrun(out: Path, launcher_args: list[str], worker_args: list[str], env: dict | None = None,
             script: Path = WORKER):
    return subprocess.run(command(out, launcher_args, worker_args, script), cwd=REPO, env=worker_env(env),
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)


def launch_two_nodes(out: Path, worker_args: list[str], env: dict | None = None, script: Path = WORKER,
                     host: str = "127.0.0.1", node_prefix=lambda node: [], node_env=lambda node: {},
                     ) -> list[subprocess.CompletedProcess]:
    """One torchrun node of one process per "host", rendezvous at `host` (node 0's address); each
    node's command starts with `node_prefix(node)` (e.g. `ip netns exec NS`) and adds `node_env(node)`."""
    endpoint = f"{host}:{free_port()}"
    procs = [
        subprocess.Popen(
            [*node_prefix(node),
             *command(out, ["--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1", "--rdzv-backend=static",
                            f"--rdzv-endpoint={endpoint}", "--max-restarts=0"], worker_args, script)],
            cwd=REPO, env=worker_env({**(env or {}), **node_env(node)}), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )
        for node in (0, 1)
    ]
    results = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return results


def command(out: Path, launcher_args: list[str], worker_args: list[str], script: Path = WORKER) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    return [sys.executable, "-m", "torch.distributed.run", *launcher_args, str(script), "--out", str(out), *worker_args]


def worker_env(extra: dict | None) -> dict:
    # One thread per process, and no pool of Inductor compile workers per rank: 2-4 ranks share 2 cores.
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONPATH": str(REPO),
            **(extra or {})}


def read_reports(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def output_tail(proc) -> str:
    """The end of a failed launch's output, led by the root-cause rank's own lines (torchrun names that
    rank; torch prefixes a rank's traceback with "[rankN]:"), which the other ranks' connection errors
    would otherwise push out of the tail."""
    text = proc.stdout + proc.stderr
    root = re.search(r"Root Cause.*?\brank\s*:\s*(\d+)", text, re.DOTALL)
    own = [line for line in text.splitlines() if root and line.startswith(f"[rank{root.group(1)}]:")]
    return ("\n".join(own[-60:]) + "\n...\n" if own else "") + text[-4000:]
