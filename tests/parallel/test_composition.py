"""Pipeline parallelism composed with every other feature, under real torchrun launches (gloo on CPU).

One engine core runs every layout (toolkit/engine/core.py): a pipeline is an executor and a batch
queue of depth pp, so speculative decoding (drafts verified and proposed on the last stage), the CPU
and disk KV tiers and swap preemption (each stage moves its own layers' KV), and expert parallelism
(each stage's experts over that stage's ranks in every replica) run pipelined unchanged. The oracle
for every case is the single process with the same engine settings, whose greedy tokens equal
transformers' (checked here for every model). Three launches, several cases each (a launch starts
2-4 processes on 2 cores):

- pp=2: n-gram speculation (chunked prefill; seeded sampling with n=2 and logprobs), a draft model
  (chunked), a CPU tier under a 3-block device cache (chunked, prefix caching: tier hits; attention
  through ATen's flash kernel, `cpu_prefill_attention="flash"`), swap
  preemption forced (chunked), a disk tier that this launch writes, a GGUF file (each stage
  de-quantizes only its layers), and weight-only int8 with a draft model (each stage quantizes its
  own linears; the draft, on the last stage, is quantized too);
- pp=2 x tp=2: a draft model (seeded sampling, n=2, logprobs; chunked; flash attention on each TP
  rank's heads, for the target's chunks and verify steps and the draft's), a MoE model with expert
  parallelism over each stage's two TP ranks (chunked), and the GGUF file (each TP rank de-quantizes
  its rows, q/k's permuted ones, and its columns: 256-aligned K-quant blocks read alone, the others cut);
- pp=2 x dp=2: a MoE model with expert parallelism over each stage's ranks in both replicas (which
  step in lockstep, dummy plans through the pipeline), the same with weight-only int8, and the disk
  tier the first launch wrote, read by these other processes (disk hits).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.checkpoints import hf_greedy, random_prompts, write_checkpoint
from tests.gguf_files import K_DIMS, Q4_K_M, write_gguf
from tests.gguf_files import hf_greedy as gguf_oracle_greedy
from tests.parallel.test_parallel import REPO, output_tail, read_reports, torchrun
from tests.parallel.test_pipeline_parallel import assert_same_samples
from tests.parallel.worker import sampled_report
from tests.speculative.checkpoints import repetitive_prompts, write_perturbed_draft
from toolkit import LLM, SamplingParams

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "parallel" / "compose_worker.py"
NEW_TOKENS = 10
CHUNKED = {"max_num_batched_tokens": 16}
# ATen's flash attention for every request step of 2+ tokens (chunks, verify steps) and cascades of 2+
# decodes over shared blocks, whatever this host's measured choice (toolkit/backends/cpu/attention_plan.py).
FLASH = {"cpu_prefill_attention": "flash"}
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=7, n=2, logprobs=2, max_tokens=6)
# One KV block (16 tokens) of the fuller stage of llama3 at pp=2 (layers 0-2: 3 layers x K and V x 2 kv
# heads x 16 dims x 4 bytes per token); the stages agree on the smaller count.
BLOCK = 16 * 3 * 2 * 2 * 16 * 4
TIER_GIB = 64 * BLOCK / 2**30


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("compose")
    llama = write_checkpoint(root / "llama3", "llama3", seed=1, num_hidden_layers=5)
    moe = write_checkpoint(root / "mixtral", "mixtral", seed=3)
    draft = write_perturbed_draft(llama, root / "draft")
    gguf = root / "llama.Q4_K_M.gguf"
    gguf_oracle = write_gguf(gguf, "llama", "Q4_K", seed=1, mix=Q4_K_M, **K_DIMS)
    # At least one whole block each, and with the new tokens within 3 blocks (the smallest cache here);
    # repeats for n-gram lookup, and two prompts twice for the tiers' prefix hits.
    base = random_prompts(6, seed=5, low=18, high=23)
    prompts = repetitive_prompts(base[:3]) + base[3:] + [base[4], base[5]]
    assert all(len(p) + NEW_TOKENS <= 48 for p in prompts)
    prompts_file = root / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    disk = root / "disk"
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    drafted = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    cases = {
        "ngram": (llama, {**CHUNKED, "speculative_config": ngram}, SAMPLED),
        "draft": (llama, {**CHUNKED, "speculative_config": drafted}, None),
        "cpu_tier": (llama, {**CHUNKED, "kv_cache_memory_bytes": 3 * BLOCK, "kv_offloading_size": TIER_GIB,
                             "enable_prefix_caching": True, **FLASH}, None),
        "swap": (llama, {**CHUNKED, "kv_cache_memory_bytes": 4 * BLOCK, "kv_offloading_size": TIER_GIB,
                         "preemption_mode": "swap"}, None),
        "disk_write": (llama, {"kv_disk_cache_dir": str(disk), "kv_disk_cache_size": 0.01,
                               "enable_prefix_caching": True}, None),
        "draft_tp": (llama, {**CHUNKED, "speculative_config": drafted, **FLASH}, SAMPLED),
        "moe_ep": (moe, {**CHUNKED, "enable_expert_parallel": True}, None),
        "gguf": (gguf, {}, None),
        "int8_draft": (llama, {**CHUNKED, "quantization": "int8", "speculative_config": drafted}, None),
        "gguf_tp": (gguf, CHUNKED, None),
        "moe_ep_dp": (moe, {"enable_expert_parallel": True}, None),
        "moe_int8_ep_dp": (moe, {"enable_expert_parallel": True, "quantization": "int8"}, None),
        "disk_read": (llama, {"kv_disk_cache_dir": str(disk), "kv_disk_cache_size": 0.01,
                              "enable_prefix_caching": True}, None),
    }
    expected = {}
    for name, (model, engine_args, sampled) in cases.items():
        # The single process with the same settings, less those that only say where KV lives (its tokens
        # do not depend on them; the byte budgets are sized for a stage, not for the whole model).
        single = {k: v for k, v in engine_args.items() if k not in (
            "enable_expert_parallel", "kv_disk_cache_dir", "kv_disk_cache_size", "kv_cache_memory_bytes",
            "kv_offloading_size", "preemption_mode")}
        llm = LLM(str(model), dtype="float32", enforce_eager=True, max_model_len=128, block_size=16,
                  skip_tokenizer_init=True, cpu_linear="torch", **single)
        greedy = llm.generate([{"prompt_token_ids": p} for p in prompts],
                              SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
        expected[name] = SimpleNamespace(tokens=[o.outputs[0].token_ids for o in greedy], sampled=None)
        if sampled:
            expected[name].sampled = [sampled_report(o) for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], SamplingParams(**sampled), use_tqdm=False)]
        del llm
    for name, model in (("ngram", llama), ("moe_ep", moe)):
        assert expected[name].tokens == hf_greedy(model, prompts, NEW_TOKENS), name
    assert expected["gguf"].tokens == gguf_oracle_greedy(gguf_oracle, prompts, NEW_TOKENS)
    return SimpleNamespace(root=root, prompts=prompts_file, cases=cases, expected=expected)


def launch(setup, tmp_path: Path, names: list[str], world: int, *layout: str) -> list[dict]:
    cases = [{"name": n, "model": str(setup.cases[n][0]), "engine_args": setup.cases[n][1],
              "sampled": setup.cases[n][2]} for n in names]
    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps(cases))
    proc = torchrun(tmp_path, [f"--nproc-per-node={world}", "--standalone"],
                    ["--cases", str(cases_file), "--prompts", str(setup.prompts), "--max-tokens", str(NEW_TOKENS),
                     *layout], script=WORKER)
    assert proc.returncode == 0, output_tail(proc)
    reports = read_reports(tmp_path, world)
    for name in names:
        got = reports[0]["cases"][name]
        assert got["tokens"] == setup.expected[name].tokens, name
        if setup.cases[name][2]:
            assert_same_samples(got["sampled"], setup.expected[name].sampled)
        assert all(r["cases"][name]["blocks_free"] for r in reports), (name, "every block free afterwards")
        assert all(r["cases"][name]["tokens"] == [] for r in reports[1:]), "only global rank 0 returns outputs"
    return reports


@pytest.fixture(scope="module")
def pp2_reports(setup, tmp_path_factory):
    """The pp=2 launch (module-wide: the pp=2 x dp=2 launch reads the disk tier it writes)."""
    names = ["ngram", "draft", "cpu_tier", "swap", "disk_write", "gguf", "int8_draft"]
    return launch(setup, tmp_path_factory.mktemp("pp2"), names, 2, "--pp", "2")


def test_pp2_with_speculation_tiers_swap_and_a_disk_tier(pp2_reports):
    reports = pp2_reports
    for rank, report in enumerate(reports):
        cases = report["cases"]
        for name in ("ngram", "draft"):  # verified on the last stage, counted on every rank alike
            spec = cases[name]["spec_decode"]
            assert spec["num_drafts"] > 0 and spec == reports[0]["cases"][name]["spec_decode"], (name, rank)
            assert cases[name]["pipeline"]["stage"] == rank
        assert 0 < cases["draft"]["spec_decode"]["num_accepted_tokens"] < cases["draft"]["spec_decode"]["num_draft_tokens"]
        assert cases["draft"]["draft_runner"] == (rank == 1), "the draft model lives on the last stage only"
        assert cases["cpu_tier"]["kv_blocks"] == 3
        assert cases["cpu_tier"]["kv_tiers"]["hit_blocks"]["cpu"] > 0, rank
        assert cases["swap"]["preemptions"] > 0 and cases["swap"]["kv_tiers"]["swapped_in"] > 0, rank
        assert cases["disk_write"]["kv_tiers"]["copied_blocks"]["device_to_disk"] > 0, rank
        assert cases["int8_draft"]["spec_decode"]["num_drafts"] > 0, rank
        # This stage's linears only: q/k/v, o, gate/up, down per layer (3 and 2 of llama's 5), the last its lm_head.
        assert cases["int8_draft"]["int8_linears"] == 4 * (3 if rank == 0 else 2) + rank, rank
        assert cases["draft"]["int8_linears"] == 0, rank


def test_pp2_x_tp2_with_a_draft_model_expert_parallel_moe_and_a_gguf_file(setup, tmp_path_factory):
    reports = launch(setup, tmp_path_factory.mktemp("pp2tp2"), ["draft_tp", "moe_ep", "gguf_tp"], 4, "--pp", "2",
                     "--tp", "2")
    for rank, report in enumerate(reports):  # ranks 0, 1: stage 1; 2, 3: stage 2
        ep = report["cases"]["moe_ep"]["expert_parallel"]
        assert ep["ranks"] == 2 and ep["experts"] == [4 * (rank % 2), 4 * (rank % 2) + 4], rank
        assert ep["calls"] > 0, rank
        assert report["cases"]["draft_tp"]["draft_runner"] == (rank == 2), "on the last stage's TP rank 0"


def test_pp2_x_dp2_with_expert_parallel_moe_and_another_launchs_disk_tier(setup, pp2_reports, tmp_path_factory):
    reports = launch(setup, tmp_path_factory.mktemp("pp2dp2"), ["moe_ep_dp", "disk_read", "moe_int8_ep_dp"], 4,
                     "--pp", "2", "--dp", "2")
    for rank, report in enumerate(reports):  # dp0: ranks 0 (stage 1), 1 (stage 2); dp1: ranks 2, 3
        ep = report["cases"]["moe_ep_dp"]["expert_parallel"]
        assert ep["ranks"] == 2 and ep["experts"] == [4 * (rank // 2), 4 * (rank // 2) + 4], rank
        # int8 with EP, DP and PP: each stage's attention linears (and the last stage's lm_head) int8.
        assert report["cases"]["moe_int8_ep_dp"]["int8_linears"] > 0, rank
    assert sum(r["cases"]["disk_read"]["kv_tiers"]["hit_blocks"]["disk"] for r in reports) > 0
