"""Disaggregated prefill/decode (#22): the layout, the router, the KV data plane, and the engine's
disaggregated mode against the colocated single process.

- The data plane under a real torchrun launch (3 processes, gloo): a request's KV blocks go from
  prefill caches into a decode cache's other blocks, re-split when the TP sizes differ (tp=2 into 1,
  1 into 2) and from two prefill instances into one decode instance; every value encodes where it
  was written, so the decode side checks each entry it got against the one the prefill side wrote,
  and that no other block changed; and three requests' untagged messages (NCCL's matching: in send
  order), loaded in another order than they were sent, each land in their own blocks
  (tests/parallel/disagg_worker.py).
- The engine (tests/parallel/disagg_engine_worker.py), one launch of 3 processes running four
  layouts in turn: 1 prefill (tp=2) + 1 decode (tp=1), 1 prefill + 1 decode (tp=2), 1 + 2 and 2 + 1,
  for two families (llama3: GQA, RoPE scaling; tied_mqa: tied embeddings, one kv head, which TP
  copies), with chunked prefill (a 16-token budget) and a one-token prompt (computed by the decode
  instance alone): greedy tokens equal the single process's (which equal transformers'), seeded
  sampling (n=2, logprobs) equals the single process's, and afterwards every KV block on every rank
  is free and no request is left. The same launch runs 1P+1D layouts with another feature on llama3
  (`composed`, half of them with chunked prefill): n-gram and draft-model speculation on the decode
  instance (its prefill instance holding one request at a time: prefill_backlog), against the single
  process with the same speculative_config; the CPU tier, the disk tier
  and swap preemption beside the handoff under a small decode cache (the decode side finds the
  repeated prompts' prefixes in its tier, swaps requests out and back in), every block free after.
- 1 prefill + 1 decode as two "hosts" in two network namespaces joined by a veth pair, compiled.
- A decode rank that hangs: global rank 0 ends the job within the collective timeout, naming it and
  its role; a prefill rank that hangs: the decode instance does, naming it. A decode rank that dies:
  the prefill rank's next send fails, naming it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections import deque
from types import SimpleNamespace

import pytest

from tests.checkpoints import hf_greedy, random_prompts, write_checkpoint
from tests.parallel.test_parallel import COMPILE_BACKEND, REPO, launch_two_nodes, output_tail, read_reports, torchrun
from tests.parallel.worker import sampled_report
from tests.speculative.checkpoints import write_perturbed_draft
from toolkit import LLM, SamplingParams
from toolkit.disaggregated import whole_requests_due
from toolkit.parallel import ParallelConfigError
from toolkit.parallel.disaggregated import DisaggLayout, HeadRoute, Router, route_requests, transfer_plan
from toolkit.parallel.tensor_parallel import kv_heads

WORKER = REPO / "tests" / "parallel" / "disagg_worker.py"


def test_layout_lays_out_prefill_then_decode_instances_and_checks_the_world():
    layout = DisaggLayout(2, 1, decode_tp=1, prefill_tp=2)
    assert [(i.role, i.index, list(i.ranks)) for i in layout.instances] == [
        ("prefill", 0, [0, 1]), ("prefill", 1, [2, 3]), ("decode", 0, [4])]
    assert layout.world_size == 5 and layout.instance_of(3).index == 1 and layout.instance_of(4).role == "decode"
    layout.check(5)
    with pytest.raises(ParallelConfigError, match=r"2 prefill instance\(s\) x 2 ranks \+ 1 decode instance\(s\) x 1 "
                                                  r"ranks = 5 processes, but this launch has a world size of 4"):
        layout.check(4)
    with pytest.raises(ParallelConfigError, match="decode_instances must be an integer >= 1"):
        DisaggLayout(1, 0)
    with pytest.raises(ParallelConfigError, match="prefill_tensor_parallel_size must be an integer >= 1"):
        DisaggLayout(1, 1, prefill_tp=0)
    # Stages and replicas: a TP-2 prefill instance, then 2 decode instances of 2 replicas of 2 stages.
    layout = DisaggLayout(1, 2, prefill_tp=2, prefill_pp=1, decode_pp=2, decode_dp=2)
    got = [(i.role, i.index, list(i.ranks), i.pp, i.tp, i.replica) for i in layout.instances]
    assert got == [("prefill", 0, [0, 1], 1, 2, 0), ("decode", 0, [2, 3], 2, 1, 0), ("decode", 1, [4, 5], 2, 1, 1),
                   ("decode", 2, [6, 7], 2, 1, 0), ("decode", 3, [8, 9], 2, 1, 1)]
    assert [[i.index for i in d] for d in layout.deployments()] == [[0], [0, 1], [2, 3]]
    with pytest.raises(ParallelConfigError, match=r"1 prefill instance\(s\) x 2 ranks \+ 2 decode instance\(s\) x 2 "
                                                  r"replicas x 2 ranks = 10 processes"):
        layout.check(8)


def test_kv_heads_follow_the_tp_plan_and_the_transfer_plan_resplits_them():
    assert [list(kv_heads(r, 2, 4)) for r in range(2)] == [[0, 1], [2, 3]]
    assert [list(kv_heads(r, 4, 2)) for r in range(4)] == [[0], [0], [1], [1]]  # fewer heads than ranks: copies
    with pytest.raises(ParallelConfigError):
        kv_heads(0, 3, 4)
    # tp=2 into tp=1: the decode rank gathers both halves; tp=1 into tp=2: each takes its half.
    assert transfer_plan(2, 1, 4) == [HeadRoute(0, 0, slice(0, 2), slice(0, 2)), HeadRoute(1, 0, slice(0, 2), slice(2, 4))]
    assert transfer_plan(1, 2, 4) == [HeadRoute(0, 0, slice(0, 2), slice(0, 2)), HeadRoute(0, 1, slice(2, 4), slice(0, 2))]
    # One kv head, copied on every prefill rank: each decode rank takes it once, from the first holder.
    assert transfer_plan(2, 2, 1) == [HeadRoute(0, 0, slice(0, 1), slice(0, 1)), HeadRoute(0, 1, slice(0, 1), slice(0, 1))]
    assert transfer_plan(2, 2, 4) == [HeadRoute(0, 0, slice(0, 2), slice(0, 2)), HeadRoute(1, 1, slice(0, 2), slice(0, 2))]


@pytest.mark.parametrize("prefill, decode, heads, layers", [
    ((1, 2), (2, 1), 4, 5),  # prefill tp2 -> decode pp2
    ((2, 1), (1, 2), 4, 5),  # prefill pp2 -> decode tp2
    ((3, 2), (2, 4), 2, 7),  # stages that cut the layers at other places; copied heads on the decode side
    ((2, 2), (2, 2), 8, 6),  # the same shape: each rank sends its own to its twin
])
def test_the_transfer_plan_gives_every_decode_rank_each_layer_and_head_it_holds_once(prefill, decode, heads, layers):
    """Every (layer, head) a decode rank's stage and TP rank hold arrives exactly once, from a prefill
    rank whose stage holds that layer and whose TP rank holds that head, at the right positions: the
    plan read back entry by entry against the stage split and the TP head rule."""
    from toolkit.parallel.pipeline import layer_partition

    (ppp, ptp), (dpp, dtp) = prefill, decode
    p_sizes, d_sizes = layer_partition(layers, ppp), layer_partition(layers, dpp)
    if ppp == dpp:
        p_sizes = d_sizes = [layers // ppp + (i < layers % ppp) for i in range(ppp)]
    else:
        d_sizes = d_sizes[::-1]  # a split of its own, unlike the prefill side's
    starts = lambda sizes: [sum(sizes[:i]) for i in range(len(sizes))]  # noqa: E731
    got = {}
    for route in transfer_plan(ptp, dtp, heads, p_sizes, d_sizes):
        ps, pt = divmod(route.prefill_rank, ptp)
        ds, dt = divmod(route.decode_rank, dtp)
        p_layers = list(range(starts(p_sizes)[ps], starts(p_sizes)[ps] + p_sizes[ps]))[route.src_layers]
        d_layers = list(range(starts(d_sizes)[ds], starts(d_sizes)[ds] + d_sizes[ds]))[route.dst_layers]
        p_heads = list(kv_heads(pt, ptp, heads))[route.src]
        d_heads = list(kv_heads(dt, dtp, heads))[route.dst]
        assert p_layers == d_layers and p_heads == d_heads and p_layers and p_heads, route
        for layer in d_layers:
            for head in d_heads:
                key = (route.decode_rank, layer, head)
                assert key not in got, key
                got[key] = route.prefill_rank
    want = {(ds * dtp + dt, layer, head) for ds in range(dpp) for dt in range(dtp)
            for layer in range(starts(d_sizes)[ds], starts(d_sizes)[ds] + d_sizes[ds]) for head in kv_heads(dt, dtp, heads)}
    assert set(got) == want


def test_a_transfer_plan_needs_both_sides_stages_of_one_model():
    with pytest.raises(ValueError, match="give both sides'"):
        transfer_plan(1, 1, 2, [2, 2], None)
    with pytest.raises(ValueError, match="give both sides'"):
        transfer_plan(1, 1, 2, [2, 2], [3, 2])


def test_router_balances_pending_prompt_tokens_and_promised_kv():
    layout = DisaggLayout(2, 2)
    # A long prompt weighs on its prefill instance; a long output on its decode instance.
    got = route_requests([1000, 10, 10, 10], [10, 2000, 10, 10], layout)
    assert [p for p, _ in got] == [0, 1, 1, 1]
    assert [d for _, d in got] == [0, 1, 0, 0]


def test_the_router_gives_a_prefill_instance_whole_requests_while_less_work_is_routed_to_it():
    """decode_token_cost 2: a 100-token prompt is 100 units of prefill work, its 100 output tokens 200
    of decode work. The first two are handed over (the prefill side's 100 + 100 is not below the decode
    side's 0, then 200); the third, 200 + 100 < 400, is served whole (prefill side 500); the fourth is
    handed over (600 >= 400). A prompt the decode side computes (handoff=False) is never whole."""
    layout = DisaggLayout(1, 1)
    got = route_requests([100] * 4, [100] * 4, layout, decode_token_cost=2.0)
    assert got == [(0, 0), (0, 0), (0, None), (0, 0)]
    assert route_requests([100] * 4, [100] * 4, layout) == [(0, 0)] * 4  # 0: a prefill instance only prefills
    router = Router(layout, decode_token_cost=2.0)
    assert [router.route(10, 1000, handoff=False) for _ in range(3)] == [(0, 0)] * 3
    assert router.route(10, 1000) == (0, None)  # the decode side has all the work: this one is served whole
    # Decoding dearer, more whole: the share served whole grows with the cost, from none.
    lens, outs = random_prompt_lens(64), [128] * 64
    whole = [sum(d is None for _, d in route_requests(lens, outs, layout, cost)) for cost in (0, 3, 8, 100)]
    assert whole[0] == 0 and all(a < b for a, b in zip(whole, whole[1:])) and whole[-1] < 64, whole


def random_prompt_lens(count: int) -> list[int]:
    return [len(p) for p in random_prompts(count, seed=3, low=16, high=512)]


def test_a_launch_that_does_not_match_the_layout_or_a_role_that_cannot_split_the_model_fails_before_loading(
        tmp_path):
    from toolkit import LLM
    from toolkit.parallel import ParallelConfigError

    path = write_checkpoint(tmp_path / "m", "tied_mqa", seed=1)  # 4 attention heads, 1 kv head
    with pytest.raises(ParallelConfigError, match=r"1 prefill instance\(s\) x 2 ranks \+ 1 decode instance\(s\) x 1 "
                                                  r"ranks = 3 processes, but this launch has a world size of 1"):
        LLM(str(path), prefill_instances=1, decode_instances=1, prefill_tensor_parallel_size=2)
    with pytest.raises(ParallelConfigError, match=r"decode instances: tensor_parallel_size 3"):
        LLM(str(path), prefill_instances=1, decode_instances=1, tensor_parallel_size=3, prefill_tensor_parallel_size=2,
            )


@pytest.mark.slow
def test_kv_blocks_move_between_instances_resplit_across_tp_sizes(tmp_path):
    proc = torchrun(tmp_path, ["--nproc-per-node=3", "--standalone"], [], script=WORKER)
    assert proc.returncode == 0, output_tail(proc)
    reports = read_reports(tmp_path, 3)
    assert [r["errors"] for r in reports] == [[], [], []]
    # Rank 1 decodes in the second layout (2 head counts), rank 2 in all three (3 x 2).
    assert [r["checked"] for r in reports] == [0, 2, 6], json.dumps(reports)


ENGINE_WORKER = REPO / "tests" / "parallel" / "disagg_engine_worker.py"
FAMILIES = ("llama3", "tied_mqa")
NEW_TOKENS = 10
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=7, n=2, logprobs=2, max_tokens=6)
P2_D1 = dict(prefill_instances=1, decode_instances=1, prefill_tensor_parallel_size=2)
P1_D2 = dict(prefill_instances=1, decode_instances=1, tensor_parallel_size=2, prefill_tensor_parallel_size=1)
P1_D_DP2 = dict(prefill_instances=1, decode_instances=1, data_parallel_size=2)  # one decode instance, 2 replicas
LAYOUTS = [P2_D1, P1_D2, dict(prefill_instances=1, decode_instances=2), dict(prefill_instances=2, decode_instances=1)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
# The engine fields whose outputs the oracle must share (the others only say where KV lives).
ORACLE_KEYS = ("speculative_config", "quantization")


UNCHUNKED = {"max_num_batched_tokens": 2048}  # the launch's default is a 16-token budget (chunked prefill)
BLOCK = 16 * 2 * 2 * 2 * 16 * 4  # one llama3 KV block on a TP-1 rank: 16 tokens x 2 layers x K, V x 2 heads x 16 x 4 B
TIER_GIB = 64 * BLOCK / 2**30


def test_a_whole_served_request_waits_only_behind_prompts_fed_before_it():
    """A prefill instance's requests served whole enter its engine behind the prompts it hands over,
    but a door that never empties (a small prefill_backlog under steady load) cannot starve them: one
    enters once every prompt fed before it has gone in, whatever came to the door after it."""
    whole = deque([(2, "a"), (5, "b"), (9, "c")])
    assert whole_requests_due(whole, door_head=1) == []  # prompt 1, fed before all of them, still waits
    assert whole_requests_due(whole, door_head=6) == ["a", "b"]  # the door holds prompts 6, 7, ... only
    assert whole_requests_due(whole, door_head=7) == [] and list(whole) == [(9, "c")]
    assert whole_requests_due(whole, door_head=None) == ["c"] and not whole  # nothing at the door


def composed(case) -> list[dict]:
    """1P+1D layouts with another feature on llama3, in the same launch as LAYOUTS, half of them with
    chunked prefill: speculative decoding on the decode instance (n-gram; a draft model, which computes
    its own prefix there); the CPU tier, the disk tier and swap preemption beside the handoff, under a
    6-block device cache on the decode instance (4 for swap; the longest request, 38 + 10 tokens, needs
    3 alone): the sampled call repeats the greedy call's prompts, so the decode side finds their
    prefixes in its tier. Under swap the four prompts of up to 13 tokens are computed on the decode side
    (max_local_prefill_tokens), queued there from the start: they fill the 4 blocks at once and
    together grow to 7, so the decode side preempts whatever the handoff's timing (handed-over requests
    arriving one by one could each finish before the next came; with 5 blocks a CI run under load
    once saw no preemption). The n-gram layout's prefill
    instance (tp=2) holds one handed-over request at a time (prefill_backlog=1): the rest wait at its
    door; it also serves some requests whole (decode_token_cost), speculating for them itself, and
    their outputs are gathered from it. A MoE
    model (mixtral) with expert parallelism: the TP-2 decode instance splits the experts over its two
    ranks (all-to-all), the TP-1 prefill instance holds them all; and the decode instance as two
    data-parallel replicas splitting the experts between them, stepping in lockstep (a dense model's
    replicas are routed apart and step alone, here with prompts of up to 17 tokens computed on the
    decode side: conditional disaggregation). Weight-only int8 on 1 prefill + 2 decode instances (one
    rank each), against the single int8 process. Priority scheduling (later prompts first) on both
    instances, under the small decode cache. (Loading requests in another order than their KV was
    sent in is checked on the data plane: test_kv_blocks_move_between_instances_resplit_across_tp_sizes.)"""
    llama = str(case.paths["llama3"])
    small = {**P2_D1, "model": llama, "kv_cache_memory_bytes": 6 * BLOCK}
    return [{**P2_D1, "model": llama, "speculative_config": NGRAM, "prefill_backlog": 1, "decode_token_cost": 4.0},
            {**P1_D2, "model": str(case.paths["mixtral"]), "enable_expert_parallel": True},
            {**P1_D_DP2, **UNCHUNKED, "model": str(case.paths["mixtral"]), "enable_expert_parallel": True},
            {**P1_D_DP2, "model": llama, "max_local_prefill_tokens": 17},
            {"prefill_instances": 1, "decode_instances": 2, "model": llama, "quantization": "int8"},
            {**P1_D2, **UNCHUNKED, "model": llama, "speculative_config": case.drafted},
            {**small, "kv_offloading_size": TIER_GIB},
            {**small, **UNCHUNKED, "scheduling_policy": "priority", "priorities": "reversed"},
            {**small, **UNCHUNKED, "kv_disk_cache_dir": str(case.root / "disk"), "kv_disk_cache_size": 0.01},
            {**small, "kv_cache_memory_bytes": 4 * BLOCK, "kv_offloading_size": TIER_GIB, "preemption_mode": "swap",
             "max_local_prefill_tokens": 13}]


def oracle(path, prompts: list[list[int]], **extra) -> tuple[list[list[int]], LLM]:
    """The single process with the same token-deciding settings (tests/parallel/test_parallel.py's
    single_process, plus `extra`)."""
    llm = LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=128, block_size=16,
              skip_tokenizer_init=True, cpu_linear="torch", **extra)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def oracle_key(family: str, layout: dict) -> str:
    return json.dumps([family, {k: layout[k] for k in ORACLE_KEYS if k in layout}], sort_keys=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("disaggregated")
    paths = {f: write_checkpoint(root / f, f, seed=1) for f in (*FAMILIES, "mixtral")}
    # Random prompts, a one-token prompt (nothing to hand over), prompts whose handed-over part (all
    # but the last token) ends exactly at a block's end and one token past it, and one that shares
    # its first block with another (a prefix-cache hit on the prefill side, in a later step).
    prompts = random_prompts(7, seed=5, low=3, high=40) + [[5], [11] * 17, [12] * 18, [11] * 16 + [13] * 9]
    prompts_file = root / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    drafted = {"method": "draft_model", "model": str(write_perturbed_draft(paths["llama3"], root / "draft")),
               "num_speculative_tokens": 2}
    expected, sampled = {}, {}
    variants = [(f, {}) for f in (*FAMILIES, "mixtral")] + [("llama3", {"speculative_config": s})
                                                             for s in (NGRAM, drafted)]
    variants.append(("llama3", {"quantization": "int8"}))
    for family, extra in variants:
        key = oracle_key(family, extra)
        expected[key], llm = oracle(paths[family], prompts, **extra)
        if not extra:
            assert expected[key] == hf_greedy(paths[family], prompts, NEW_TOKENS), family
        sampled[key] = [sampled_report(o) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(**SAMPLED), use_tqdm=False)]
        del llm
    return SimpleNamespace(paths=paths, prompts=prompts_file, expected=expected, sampled=sampled, root=root,
                           drafted=drafted)


def engine_args(case, layouts, *flags: str, families=FAMILIES) -> list[str]:
    models = [arg for family in families for arg in ("--model", str(case.paths[family]))]
    return [*models, "--prompts", str(case.prompts), "--max-tokens", str(NEW_TOKENS),
            *[arg for layout in layouts for arg in ("--layout", json.dumps(layout))], *flags,
            "--engine-args", json.dumps({"cpu_linear": "torch", "max_num_batched_tokens": 16})]


def check_runs(case, reports: list[dict], runs: int) -> None:
    assert all(len(r["runs"]) == runs for r in reports)
    for i, run in enumerate(reports[0]["runs"]):
        family = next(f for f, path in case.paths.items() if str(path) == run["model"])
        where = f"{run['layout']} {family}"
        key = oracle_key(family, run["layout"])
        assert run["tokens"] == case.expected[key], where
        if run["sampled"] is not None:
            assert _tokens(run["sampled"]) == _tokens(case.sampled[key]), where
            for got, want in zip(run["sampled"], case.sampled[key]):
                for g, w in zip(got["outputs"], want["outputs"]):
                    for ge, we in zip(g["logprobs"], w["logprobs"]):
                        assert ge.keys() == we.keys() and all(abs(ge[k] - we[k]) < 1e-4 for k in ge), where
        for r in reports:  # nothing stranded on either side
            mine = r["runs"][i]
            assert mine["all_blocks_free"] and mine["running"] == 0, (r["rank"], where)
        roles = [r["runs"][i]["disaggregated"] for r in reports]
        # Every handed-over request's KV left a prefill instance and arrived at a decode instance (a
        # TP instance's ranks count alike: its first speaks), and every prompt of more than one
        # token was handed over: the decode side computed none of them itself.
        sent = sum(d["handoff"]["requests"] for d in roles if d["role"] == "prefill" and d["local_rank"] == 0)
        received = sum(d["kv"]["transfers"] for d in roles if d["role"] == "decode" and d["local_rank"] == 0)
        # (conditional disaggregation: prompts up to max_local_prefill_tokens stay on the decode side)
        local = max(1, run["layout"].get("max_local_prefill_tokens", 0))
        handed = sum(len(p) > local for p in json.loads(case.prompts.read_text()))
        # (decode_token_cost: the prefill instance serves some requests whole, and returns their outputs)
        served = sum(d["served"]["requests"] for d in roles if d["role"] == "prefill" and d["local_rank"] == 0)
        assert (served > 0) == ("decode_token_cost" in run["layout"]), (where, roles)
        assert sent == received == handed * (2 if run["sampled"] is not None else 1) - served, (where, roles)
        assert all(d["handoff"]["failed"] == d["handoff"]["dropped"] == 0 for d in roles), (where, roles)
        assert all("toolkit:disagg_kv_bytes" in r["runs"][i]["metrics"] for r in reports)
        # Prefix caching works on the prefill side: the sampled run finds every prompt's full blocks.
        if run["sampled"] is not None:
            hits = sum(r["runs"][i]["prefix_cache"]["hits"] for r, d in zip(reports, roles)
                       if d["role"] == "prefill" and d["local_rank"] == 0)
            assert hits > 0, where
        check_composed(run["layout"], [r["runs"][i] for r in reports], roles, where)


def check_composed(layout: dict, runs: list[dict], roles: list[dict], where: str) -> None:
    """What the features composed with a layout did, rank by rank."""
    for run, role in zip(runs, roles):
        # Where the logits are: a decode instance's last stage's first rank.
        samples_here = role["role"] == "decode" and role["stage"] == role["pp"] - 1 and role["tp_rank"] == 0
        if "speculative_config" in layout:  # on the decode instance alone (and a prefill instance serving
            spec = run["spec_decode"]       # requests whole); the draft model where the logits are
            assert (spec is not None) == (role["role"] == "decode" or "decode_token_cost" in layout), (where, role)
            assert spec is None or spec["num_drafts"] > 0, (where, role)
            drafts_here = layout["speculative_config"]["method"] == "draft_model" and samples_here
            assert run["draft_runner"] == drafts_here, (where, role)
        # Every linear int8 on both roles (2 layers x 4, and the lm_head), none otherwise.
        assert run["int8_linears"] == (9 if layout.get("quantization") == "int8" else 0), (where, role)
        if layout.get("enable_expert_parallel"):  # each instance's experts over its own ranks (its replicas' too)
            ep, size, at = run["expert_parallel"], role["tp"] * role["dp"], role["replica"] * role["tp"] + role["tp_rank"]
            assert ep["ranks"] == size and ep["experts"] == [8 // size * at, 8 // size * (at + 1)], (where, role, ep)
            assert ep["rows_received"] > 0, (where, role, ep)
            # A decode instance's replicas step together: they agree on every step (the lockstep).
            assert ("lockstep_steps" in ep) == (role["dp"] > 1), (where, role, ep)
            assert role["dp"] == 1 or ep["lockstep_steps"] > 0, (where, role, ep)
        if role["role"] == "decode" and layout.get("data_parallel_size", 1) > 1:  # each replica served some
            assert role["dp"] == layout["data_parallel_size"] and role["kv"]["transfers"] > 0, (where, role)
        if "prefill_backlog" in layout and role["role"] == "prefill" and role["local_rank"] == 0:
            handoff = role["handoff"]  # every request fed at once: most waited, and never more were held
            assert handoff["door_waits"] > 0 and handoff["max_backlog"] == layout["prefill_backlog"], (where, handoff)
        tiers = run["kv_tiers"]
        if role["role"] == "decode" and "kv_cache_memory_bytes" in layout:
            assert run["kv_blocks"] == layout["kv_cache_memory_bytes"] // BLOCK, (where, role)
        if "preemption_mode" in layout and role["role"] == "decode":  # swapped out and back in, beside the handoff
            assert run["preemptions"] > 0 and tiers["swapped_in"] > 0, (where, role, tiers)
        elif "kv_offloading_size" in layout and role["role"] == "decode":  # the repeated prompts' prefixes
            assert tiers["hit_blocks"]["cpu"] > 0, (where, role, tiers)
        if "kv_disk_cache_dir" in layout:  # every rank writes through; the decode side reads its entries back
            assert tiers["copied_blocks"]["device_to_disk"] > 0, (where, role, tiers)
            assert role["role"] == "prefill" or tiers["hit_blocks"]["disk"] > 0, (where, role, tiers)


def _tokens(sampled: list[dict]) -> list:
    return [[o["tokens"] for o in s["outputs"]] for s in sampled]


@pytest.mark.slow
def test_prefill_and_decode_instances_give_the_single_process_outputs(case, tmp_path):
    """One launch, four layouts x two families: greedy and seeded sampling against the single process,
    then half the requests aborted before their prefill."""
    layouts = LAYOUTS + composed(case)
    proc = torchrun(tmp_path, ["--nproc-per-node=3", "--standalone"],
                    engine_args(case, layouts, "--sampled", json.dumps(SAMPLED), "--abort-half"), script=ENGINE_WORKER)
    assert proc.returncode == 0, output_tail(proc)
    reports = read_reports(tmp_path, 3)
    check_runs(case, reports, len(LAYOUTS) * len(FAMILIES) + len(layouts) - len(LAYOUTS))
    check_aborted(case, reports)


def check_aborted(case, reports: list[dict]) -> None:
    """Then on each engine: every prompt added and every other one aborted at once (at its prefill
    instance's door, or awaited by its decode instance): the rest finish with the single process's
    tokens, the aborted return nothing, and every block on every rank is free again."""
    for i, run in enumerate(reports[0]["runs"]):
        family = next(f for f, path in case.paths.items() if str(path) == run["model"])
        expected = case.expected[oracle_key(family, run["layout"])]
        assert run["aborted_run"] == {f"abort-{j}": expected[j] for j in range(1, len(expected), 2)}, run["layout"]
        assert all(r["runs"][i]["blocks_free_after_abort"] for r in reports), run["layout"]


# Instances of other shapes than one TP group (4 processes): the prefill tp2 -> decode pp2, and
# prefill pp2 -> decode tp2; the stages' layers and the TP ranks' heads are re-split on the way.
P_TP2_D_PP2 = dict(prefill_instances=1, decode_instances=1, prefill_tensor_parallel_size=2,
                   prefill_pipeline_parallel_size=1, pipeline_parallel_size=2)
P_PP2_D_TP2 = dict(prefill_instances=1, decode_instances=1, prefill_pipeline_parallel_size=2,
                   prefill_tensor_parallel_size=1, tensor_parallel_size=2)


@pytest.mark.slow
def test_pipelined_instances_give_the_single_process_outputs(case, tmp_path):
    """One launch of 4 processes: prefill tp2 -> decode pp2 and prefill pp2 -> decode tp2 for both
    families (chunked prefill), greedy and seeded sampling against the single process, then half the
    requests aborted; with them, draft-model speculation on the pp2 decode instance (the draft on its
    last stage, unchunked), mixtral with expert parallelism inside the tp2 prefill instance (the
    decode stages each hold all experts of their layer; that prefill instance also serves some requests
    whole, decoding them with its experts split over its two ranks), and the pp2 prefill instance
    serving some requests whole (decode_token_cost: it decodes them through its own two stages)."""
    llama = str(case.paths["llama3"])
    layouts = [P_TP2_D_PP2, P_PP2_D_TP2,
               {**P_TP2_D_PP2, **UNCHUNKED, "model": llama, "speculative_config": case.drafted},
               {**P_TP2_D_PP2, "model": str(case.paths["mixtral"]), "enable_expert_parallel": True,
                "decode_token_cost": 4.0},
               {**P_PP2_D_TP2, "model": llama, "decode_token_cost": 4.0}]
    proc = torchrun(tmp_path, ["--nproc-per-node=4", "--standalone"],
                    engine_args(case, layouts, "--sampled", json.dumps(SAMPLED), "--abort-half"), script=ENGINE_WORKER)
    assert proc.returncode == 0, output_tail(proc)
    reports = read_reports(tmp_path, 4)
    check_runs(case, reports, 2 * len(FAMILIES) + 3)
    check_aborted(case, reports)
    for i, run in enumerate(reports[0]["runs"]):  # each rank's cache holds its stage's layers alone
        layers = 3 if "mixtral" in run["model"] else 2
        for role in ("prefill", "decode"):
            stages = [(r["runs"][i]["disaggregated"], r["runs"][i]["kv_layers"]) for r in reports]
            stages = [n for d, n in stages if d["role"] == role and d["tp_rank"] == 0]
            pp = len(stages)
            assert sum(stages) == layers and (pp == 1 or max(stages) < layers), (run["layout"], role, stages)


@pytest.mark.slow
@pytest.mark.parametrize("hung_rank, waiting_rank, hung_name", [
    (1, 0, "rank 1 (decode instance 0, TP rank 0 of 1)"),
    (0, 1, "rank 0 (prefill instance 0, TP rank 0 of 1)"),
])
def test_a_hung_instance_ends_the_job_within_the_timeout_naming_its_rank_and_role(case, tmp_path, hung_rank,
                                                                                  waiting_rank, hung_name):
    layout = dict(prefill_instances=1, decode_instances=1)
    flags = ("--fail-rank", str(hung_rank), "--fail-mode", "hang")
    proc = torchrun(tmp_path, ["--nproc-per-node=2", "--standalone"],
                    engine_args(case, [layout], *flags, families=FAMILIES[:1]), env={"TOOLKIT_DIST_TIMEOUT": "10"},
                    script=ENGINE_WORKER)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "RuntimeError: rank" in line]
    assert any(line.split("RuntimeError: ")[1].startswith(f"rank {waiting_rank} ") and hung_name in line
               and "hung or dead" in line for line in errors), output_tail(proc)


@pytest.mark.slow
def test_a_killed_decode_instance_ends_the_job_naming_it(case, tmp_path):
    """The decode rank's process exits in its third step (as on a host that died): the prefill rank's
    send of the next request's KV fails and the job ends with an error naming the dead rank and its
    role. Nothing waits on the dead side: the prefill side's blocks were freed when their KV was staged.
    (--monitor-interval=15, past the 10 s collective timeout: the surviving rank may learn of the death
    only from that timeout, and must get to say so before torchrun's agent stops it. With a 2 s poll
    the agent stopped it first once, under the suite's two workers.)"""
    layout = dict(prefill_instances=1, decode_instances=1)
    proc = torchrun(tmp_path, ["--nproc-per-node=2", "--standalone", "--monitor-interval=15"],
                    engine_args(case, [layout], "--fail-rank", "1", "--fail-mode", "exit", families=FAMILIES[:1]),
                    env={"TOOLKIT_DIST_TIMEOUT": "10"}, script=ENGINE_WORKER)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "RuntimeError: rank 0 " in line]
    assert any("rank 1 (decode instance 0, TP rank 0 of 1)" in line for line in errors), output_tail(proc)


class TwoHosts:
    """Two network namespaces joined by a veth pair: "hosts" with their own addresses and network
    stacks on this machine (root and iproute2 needed, as on every machine this suite runs on)."""

    ADDRESSES = ("10.77.0.1", "10.77.0.2")

    def __init__(self):
        tag = uuid.uuid4().hex[:6]
        self.names = [f"tk-{tag}-{i}" for i in range(2)]
        self.links = [f"tkv{tag}{i}" for i in range(2)]

    def __enter__(self):
        try:
            for name in self.names:
                ip("netns", "add", name)
            ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            for name, link, address in zip(self.names, self.links, self.ADDRESSES):
                ip("link", "set", link, "netns", name)
                ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
                ip("-n", name, "link", "set", link, "up")
                ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for name in self.names:  # removing a namespace removes its end of the veth pair, and so both
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def launch(self, out, worker_args: list[str]) -> list[subprocess.CompletedProcess]:
        """One torchrun node per host, the rendezvous and process group over the veth pair."""
        return launch_two_nodes(out, worker_args, script=ENGINE_WORKER, host=self.ADDRESSES[0],
                                node_prefix=lambda node: ["ip", "netns", "exec", self.names[node]],
                                node_env=lambda node: {"GLOO_SOCKET_IFNAME": self.links[node]})


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.mark.slow
def test_prefill_and_decode_on_two_hosts_over_a_real_network_stack(case, tmp_path):
    """1 prefill + 1 decode, each in its own network namespace: the rendezvous, the control plane
    and the KV travel over the veth pair, and the tokens are the single process's. Compiled (the
    step traced whole, as the parallel suites do), where the other launches here run eagerly."""
    assert shutil.which("ip"), "iproute2's ip is needed for the two-host test"
    layout = dict(prefill_instances=1, decode_instances=1)
    with TwoHosts() as hosts:
        procs = hosts.launch(tmp_path, engine_args(case, [layout], "--compile", COMPILE_BACKEND,
                                                   families=FAMILIES[1:]))
    for proc in procs:
        assert proc.returncode == 0, output_tail(proc)
    reports = read_reports(tmp_path, 2)
    check_runs(case, reports, 1)
    assert all(r["runs"][0]["compiled_graphs"] >= 1 for r in reports), reports
