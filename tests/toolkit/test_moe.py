"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) and the routed experts op.

The oracles: transformers on the same seeded checkpoints (greedy tokens exact, prefill logits within
1e-4 in float32), eager and compiled (one graph, no breaks), with chunked prefill and with preemption
forced; for the op `toolkit::moe_experts`, a per-token loop over the routed experts.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.checkpoints import MOE_FAMILIES, hf_greedy, random_prompts, write_checkpoint
from tests.toolkit.test_parity import check_prefill_logits, count_preemptions, first_diff, make_llm, prefill_logits
from toolkit import LLM, SamplingParams
from toolkit.config import UnsupportedModelError, load_model_config
from toolkit.moe import ops as moe_ops
from toolkit.moe.ops import moe_experts, moe_experts_torch

NUM_PROMPTS = 6
NEW_TOKENS = 24

# --- the op ------------------------------------------------------------------------------------


def naive_experts(x, w13, w2, weights, ids, first_expert=0):
    """Token by token, slot by slot: the definition."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    I = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - first_expert
            if not 0 <= e < w13.shape[0]:
                continue
            xt = x[t].double()
            h = F.silu(w13[e, :I].double() @ xt) * (w13[e, I:].double() @ xt)
            out[t] += float(weights[t, j]) * (w2[e].double() @ h)
    return out.to(x.dtype)


def random_experts(T, E, k, H=24, I=20, seed=0, num_experts=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.2
    w2 = torch.randn(E, H, I, generator=g) * 0.2
    ids = torch.stack([torch.randperm(num_experts or E, generator=g)[:k] for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.int64)
    weights = torch.rand(T, k, generator=g)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("T,k", [(1, 1), (7, 2), (33, 3)])
def test_reference_matches_a_per_token_loop_with_empty_experts(T, k):
    # 8 experts, routed only among the first 5: experts 5..7 receive nothing; odd row counts.
    x, w13, w2, weights, ids = random_experts(T, 8, k, seed=T, num_experts=5)
    counts = torch.zeros(8, dtype=torch.int64)
    got = moe_experts(x, w13, w2, weights, ids, 0, counts)
    torch.testing.assert_close(got, naive_experts(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    assert counts.tolist() == torch.bincount(ids.reshape(-1), minlength=8).tolist()


def test_ids_outside_the_local_range_contribute_nothing():
    """A rank holding experts [4, 8) of 12: pairs routed elsewhere add zero and are not counted."""
    x, _, _, weights, ids = random_experts(19, 12, 3, seed=3)
    _, w13, w2, _, _ = random_experts(1, 4, 1, seed=4)
    counts = torch.zeros(12, dtype=torch.int64)
    got = moe_experts(x, w13, w2, weights, ids, 4, counts)
    torch.testing.assert_close(got, naive_experts(x, w13, w2, weights, ids, first_expert=4), atol=1e-5, rtol=1e-5)
    local = ids[(ids >= 4) & (ids < 8)]
    assert counts.tolist() == torch.bincount(local, minlength=12).tolist()
    # Summed over a partition of the experts, the ranks' outputs are the whole layer's.
    _, w13_all, w2_all, _, _ = random_experts(1, 12, 1, seed=5)
    parts = sum(moe_experts(x, w13_all[r:r + 4], w2_all[r:r + 4], weights, ids, r) for r in (0, 4, 8))
    torch.testing.assert_close(parts, moe_experts(x, w13_all, w2_all, weights, ids), atol=1e-5, rtol=1e-5)


def test_skewed_routing_every_token_to_one_expert():
    x, w13, w2, _, _ = random_experts(40, 8, 2, seed=6)
    ids = torch.full((40, 2), 3, dtype=torch.int64)
    weights = torch.tensor([[0.25, 0.5]]).expand(40, 2).contiguous()
    gate, up = (x @ w13[3].T).chunk(2, dim=-1)
    dense = (F.silu(gate) * up) @ w2[3].T
    torch.testing.assert_close(moe_experts(x, w13, w2, weights, ids), 0.75 * dense, atol=1e-5, rtol=1e-5)


def test_half_inputs_weight_and_sum_in_float32():
    x, w13, w2, weights, ids = random_experts(9, 8, 2, seed=7)
    got = moe_experts(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert got.dtype == torch.bfloat16
    exact = naive_experts(x.bfloat16().float(), w13.bfloat16().float(), w2.bfloat16().float(), weights, ids)
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=2e-2)


def test_no_tokens():
    x, w13, w2, weights, ids = random_experts(0, 8, 2)
    assert moe_experts(x, w13, w2, weights, ids).shape == (0, 24)


def test_op_traces_whole_and_counts_in_the_compiled_graph():
    from torch._dynamo.utils import counters

    x, w13, w2, weights, ids = random_experts(13, 8, 2, seed=8)
    counts = torch.zeros(8, dtype=torch.int64)

    def layer(x, weights, ids, counts):
        return moe_experts(x * 2, w13, w2, weights, ids, 0, counts) + 1

    counters["graph_break"].clear()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="eager")
    torch.testing.assert_close(compiled(x, weights, ids, counts), layer(x, weights, ids, torch.zeros(8, dtype=torch.int64)))
    assert dict(counters["graph_break"]) == {}
    assert counts.tolist() == torch.bincount(ids.reshape(-1), minlength=8).tolist()


def test_a_registered_implementation_serves_its_device():
    calls = []

    def impl(x, w13, w2, weights, ids, first_expert):
        calls.append(first_expert)
        return moe_experts_torch(x, w13, w2, weights, ids, first_expert)

    x, w13, w2, weights, ids = random_experts(5, 8, 2, seed=9)
    moe_ops.register_impl("cpu", impl)
    try:
        assert moe_ops.impl_for(torch.device("cpu")) is impl
        moe_experts(x, w13, w2, weights, ids, 0)
    finally:
        moe_ops.register_impl("cpu", None)
    assert calls == [0] and moe_ops.impl_for(torch.device("cpu")) is moe_experts_torch


# --- the models against transformers -----------------------------------------------------------

# Each family: the reference ops eagerly in the normal configuration, then with the CPU kernels
# eager and compiled, with chunked prefill forced and with preemption forced.
CASES = [("eager-torch", "default")] + [(b, m) for b in ("eager-kernels", "compiled-kernels")
                                        for m in ("chunked_prefill", "preemption")]
MODES = {"default": {}, "chunked_prefill": {"max_num_batched_tokens": 12}, "preemption": {"kv_blocks": 6}}
# 2 * layers * kv_heads * head_dim * 4 bytes
BYTES_PER_TOKEN = {"mixtral": 768, "qwen2_moe": 768, "qwen3_moe": 1536, "qwen3_moe_step2": 768}


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def moe_case(request, tmp_path_factory):
    family = request.param
    path = write_checkpoint(tmp_path_factory.mktemp(family), family, seed=1)
    prompts = random_prompts(NUM_PROMPTS, seed=2, low=3, high=40)
    return family, path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


def moe_llm(family, path, backend, mode="default") -> LLM:
    kwargs = dict(MODES[mode])
    blocks = kwargs.pop("kv_blocks", None)
    if blocks is not None:
        kwargs["kv_cache_memory_bytes"] = blocks * 16 * BYTES_PER_TOKEN[family]
    return make_llm(family, path, backend, **kwargs)


@pytest.mark.parametrize("backend,mode", CASES)
def test_greedy_tokens_match_transformers(moe_case, backend, mode, one_torch_thread):
    from torch._dynamo.utils import counters

    family, path, prompts, expected = moe_case
    counters["graph_break"].clear()
    llm = moe_llm(family, path, backend, mode)
    seen = count_preemptions(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{family}/{backend}/{mode}: prompt {i} (len {len(prompts[i])}) diverges at {first_diff(g, e)}"
    if backend.startswith("compiled"):
        assert llm.engine.stats()["graphs"] == 1
        assert dict(counters["graph_break"]) == {}, "the MoE step must trace as one graph"
    if mode == "preemption":
        assert seen["count"] > 0, "the KV budget was meant to force preemption"
    if mode == "chunked_prefill":
        assert max(seen["tokens"]) <= 12
    # Every token computed in a sparse layer was routed to top_k experts, and the metric says so.
    mc = llm.engine.model_config
    tokens = sum(seen["tokens"])
    per_layer = {}
    for m in llm.get_metrics():
        if m.name == "toolkit:moe_expert_tokens":
            per_layer.setdefault(int(m.labels["layer"]), []).append(m.value)
    assert sorted(per_layer) == [i for i, sparse in enumerate(mc.moe.sparse_layers) if sparse]
    assert all(len(v) == mc.moe.num_experts and sum(v) == mc.moe.top_k * tokens for v in per_layer.values())


@pytest.mark.parametrize("backend", ["eager-kernels", "eager-torch"])
def test_prefill_logits_match_transformers(moe_case, backend, one_torch_thread):
    family, path, prompts, _ = moe_case
    check_prefill_logits(family, path, prompts[:3], backend)


def test_bfloat16_prefill_logits_are_as_close_as_transformers_in_bfloat16(moe_case, one_torch_thread):
    """No exact answer in bf16: the oracle is the float32 model, and ours must land as near it as
    transformers in bf16 (which rounds Qwen's routing weights to bf16, as ours does). A router near a
    tie picks another expert at a few positions, in ours or in theirs, so the error is averaged over
    the positions (each position's worst logit)."""
    from transformers import AutoModelForCausalLM

    family, path, prompts, _ = moe_case
    runner = make_llm(family, path, dtype="bfloat16").engine.runner
    exact = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for prompt in prompts[:3]:
        ours = prefill_logits(runner, prompt).float()
        with torch.no_grad():
            truth = exact(torch.tensor([prompt])).logits[0]
            theirs = hf16(torch.tensor([prompt])).logits[0].float()
        ours_err = (ours - truth).abs().amax(-1).mean().item()
        theirs_err = (theirs - truth).abs().amax(-1).mean().item()
        assert ours_err <= 2 * theirs_err + 1e-3, f"{family}: bf16 error {ours_err:.4f}, transformers' {theirs_err:.4f}"


# --- config, loading, info -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_moe_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen2_moe"), "qwen2_moe", seed=0)


def test_layers_are_sparse_where_transformers_makes_them(tmp_path):
    import transformers

    for family in ("qwen2_moe", "qwen3_moe_step2", "mixtral"):
        path = write_checkpoint(tmp_path / family, family, seed=0)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path)
        want = tuple("Sparse" in type(layer.mlp).__name__ for layer in hf.model.layers)
        config = load_model_config(path)
        assert config.moe.sparse_layers == want, family
        stored = sum(t.numel() for t in hf.state_dict().values())
        assert config.num_parameters == stored, family
    assert load_model_config(tmp_path / "qwen2_moe").moe.sparse_layers == (True, False, True)


@pytest.mark.parametrize("field,value", [("scoring_func", "sigmoid"), ("n_group", 4), ("topk_method", "noaux_tc"),
                                         ("routed_scaling_factor", 2.5), ("num_experts_per_tok", 9)])
def test_routing_options_not_implemented_are_refused(qwen2_moe_ckpt, tmp_path, field, value):
    import shutil

    path = tmp_path / "model"
    shutil.copytree(qwen2_moe_ckpt, path)
    raw = json.loads((path / "config.json").read_text())
    raw[field] = value
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match=field):
        load_model_config(path)


def test_loader_reads_only_local_experts_and_names_missing_ones(qwen2_moe_ckpt, tmp_path):
    """Expert parallelism's shape: a layer holding experts [4, 8) reads only theirs; tensor parallelism's:
    a read_slice keeping half of each expert's intermediate rows; a skipped expert is reported missing."""
    from torch import nn

    from toolkit.models.moe import Experts
    from toolkit.weights import CheckpointError, build_model, load_weights

    config = load_model_config(qwen2_moe_ckpt)
    full = build_model(config, 64)
    load_weights(full, qwen2_moe_ckpt, torch.float32, torch.device("cpu"))

    def local_model(num_local, first, intermediate):
        model = build_model(config, 64)
        for m in model.modules():
            if isinstance(m, Experts):
                m.first_expert = first
                h = m.w13.shape[2]
                m.w13 = nn.Parameter(torch.empty(num_local, 2 * intermediate, h, device="meta"))
                m.w2 = nn.Parameter(torch.empty(num_local, h, intermediate, device="meta"))
        return model

    read = []
    model = local_model(4, 4, 32)
    load_weights(model, qwen2_moe_ckpt, torch.float32, torch.device("cpu"),
                 read_slice=lambda name, sl: read.append(name) or sl[:])
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
    assert experts == {4, 5, 6, 7}
    ours, theirs = model.model.layers["0"].mlp.experts, full.model.layers["0"].mlp.experts
    assert torch.equal(ours.w13, theirs.w13[4:]) and torch.equal(ours.w2, theirs.w2[4:])

    def half_intermediate(name, sl):  # rank 1 of 2 over the experts' intermediate dimension
        if ".experts." not in name:
            return sl[:]
        return sl[:, 16:] if name.endswith("down_proj.weight") else sl[16:]

    model = local_model(8, 0, 16)
    load_weights(model, qwen2_moe_ckpt, torch.float32, torch.device("cpu"), read_slice=half_intermediate)
    ours = model.model.layers["2"].mlp.experts
    full2 = full.model.layers["2"].mlp.experts
    assert torch.equal(ours.w13[:, :16], full2.w13[:, 16:32]) and torch.equal(ours.w13[:, 16:], full2.w13[:, 48:])
    assert torch.equal(ours.w2, full2.w2[:, :, 16:])

    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_weights(build_model(config, 64), qwen2_moe_ckpt, torch.float32, torch.device("cpu"),
                     skip=lambda name: name == "model.layers.2.mlp.experts.5.up_proj.weight")


def test_info_shows_total_and_active_parameters(qwen2_moe_ckpt):
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from toolkit.cli.main import app

    result = CliRunner().invoke(app, ["info", str(qwen2_moe_ckpt), "--json", "--memory", "1MiB"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    tensors = load_file(qwen2_moe_ckpt / "model.safetensors")
    assert info["num_parameters"] == info["checkpoint_parameters"] == sum(t.numel() for t in tensors.values())
    # Per token: every tensor but the 6 routed experts (of 8) it does not use, in each of the 2 sparse layers.
    unused = sum(t.numel() for name, t in tensors.items() if ".experts." in name) * 6 // 8
    assert info["num_active_parameters"] == info["num_parameters"] - unused
    assert (info["num_experts"], info["num_experts_per_tok"], info["num_sparse_layers"]) == (8, 2, 2)
    table = CliRunner().invoke(app, ["info", str(qwen2_moe_ckpt), "--memory", "1MiB"])
    assert f"active parameters per token {info['num_active_parameters']:,} of {info['num_parameters']:,}" in table.stdout
