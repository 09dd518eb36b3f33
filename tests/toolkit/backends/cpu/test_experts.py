"""The CPU experts (toolkit/backends/cpu/experts.py) against a float64 per-(token, slot) loop, under
each layout plan, and in the engine: a MoE model on the CPU kernels runs them and keeps
transformers' tokens."""

import pytest
import torch
import torch.nn.functional as F

from tests.checkpoints import hf_greedy, random_prompts, write_checkpoint
from toolkit import LLM, SamplingParams
from toolkit.backends.cpu import experts as cpu_experts
from toolkit.backends.cpu import kernels
from toolkit.backends.cpu.linear import NEVER, LinearPlan, onednn_native
from toolkit.models.moe import Experts
from toolkit.moe import ops

PLANS = {
    "panels": LinearPlan(panels=True, onednn=False, small_m=NEVER, source="test"),
    "onednn": LinearPlan(panels=False, onednn=True, small_m=0, source="test"),
    "both": LinearPlan(panels=True, onednn=True, small_m=3, source="test"),  # panels up to 3 rows
}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.load() == {}
    yield
    ops.register_impl("cpu", None)  # the other modules' engines choose for themselves


def _experts(E, H, I, dtype, seed, first_expert=0, local=None) -> Experts:
    g = torch.Generator().manual_seed(seed)
    m = Experts(E, H, I, num_local_experts=local, first_expert=first_expert)
    with torch.no_grad():
        m.w13.copy_(torch.randn(m.w13.shape, generator=g) / H**0.5)
        m.w2.copy_(torch.randn(m.w2.shape, generator=g) / I**0.5)
    return m.to(dtype)


def _oracle(x, m: Experts, weights, ids) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    w13, w2 = m.w13.double(), m.w2.double()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - m.first_expert
            if 0 <= e < w13.shape[0]:
                gate, up = (x[t].double() @ w13[e].T).chunk(2)
                out[t] += float(weights[t, j]) * ((F.silu(gate) * up) @ w2[e].T)
    return out


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("routing", ["random", "skewed", "ep"])
@pytest.mark.parametrize("hidden,inter", [(40, 24), (96, 64)])  # (96, 64): whole blocks of 32 k on AMX too
def test_cpu_experts_match_float64(plan, dtype, tol, routing, hidden, inter):
    if PLANS[plan].onednn and not onednn_native(dtype):
        # oneDNN packs bf16 only with native units (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); without them
        # plan_for never chooses it (tests/toolkit/backends/cpu/test_linear.py, test_plans_by_rule_and_by_config).
        pytest.skip(f"oneDNN has no native {dtype} on this CPU: the engine never plans oneDNN experts here")
    # 38 tokens: skewed, two experts get 37 rows each, which oneDNN is called with padded to 38 (onednn_rows).
    E, H, I, T, k = 8, hidden, inter, 38, 2
    g = torch.Generator().manual_seed(3)
    first, local = (4, 4) if routing == "ep" else (0, None)
    m = _experts(E, H, I, dtype, seed=1, first_expert=first, local=local)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.randint(0, E, (T, k), generator=g)
    if routing == "skewed":
        ids[:, 0], ids[:, 1] = 5, 2  # every token on the same two experts: rows past both small_m paths
    ids[3] = torch.tensor([6, 6])  # one token on one expert twice
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    assert cpu_experts.pack_experts(torch.nn.ModuleList([m]), PLANS[plan], PLANS[plan].small_m) == (1, PLANS[plan].small_m)
    assert ops.impl_for(torch.device("cpu")) is cpu_experts.moe_experts_cpu
    with torch.profiler.profile() as prof:
        out = ops.moe_experts(x, m.w13, m.w2, weights, ids, first)
    assert "toolkit::experts_cpu" in {e.name for e in prof.events()}, "the packed experts did not serve the op"
    ref = _oracle(x, m, weights, ids)
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max()
    # The layer's own dispatcher (what the compiled step calls): the kernel straight, counting the pairs
    # each local expert received into the layer's global counters.
    assert isinstance(m.dispatcher, cpu_experts.PackedExperts)
    direct = m(x, weights, ids)
    assert torch.equal(direct, out)
    local = ids[(ids >= first) & (ids < first + m.num_local_experts)]
    assert m.tokens_per_expert.tolist() == torch.bincount(local, minlength=E).tolist()


def test_a_moe_model_on_the_cpu_kernels_runs_them_and_keeps_transformers_tokens(tmp_path):
    ckpt = write_checkpoint(tmp_path, "qwen3_moe", seed=4)
    prompts = random_prompts(3, seed=6, low=5, high=30)
    llm = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=96)
    assert any("MoE layers packed" in c for c in llm.engine.stats()["model_changes"])
    assert ops.impl_for(torch.device("cpu")) is cpu_experts.moe_experts_cpu
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(ckpt, prompts, 8)


def test_the_experts_crossover_is_measured_on_their_shapes_cached_and_keeps_only_its_layouts(tmp_path, monkeypatch):
    """Under a plan with both layouts the experts measure their own crossover: with the experts op itself,
    panels against oneDNN on the same rows (their outputs agree), the panels up to the last row count
    before oneDNN's lasting win; the result is cached per shape, and a layer keeps only the layouts the
    crossover uses."""
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    both = LinearPlan(panels=True, onednn=True, small_m=512, source="measured")
    H, I = 64, 32
    rows = []

    def fake_best_of_each(run, reps=5):
        panel_out, onednn_out = run(True), run(False)
        rows.append(panel_out.shape[0])
        torch.testing.assert_close(panel_out, onednn_out, rtol=1e-4, atol=1e-5)
        return 1.0, (0.5 if panel_out.shape[0] >= 24 else 2.0)  # oneDNN wins from 24 rows an expert on

    monkeypatch.setattr(cpu_experts, "best_of_each", fake_best_of_each)
    assert cpu_experts.choose_small_m(both, torch.float32, H, I) == (16, "measured")
    assert rows == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]  # stopped at oneDNN's second win in a row
    assert cpu_experts.choose_small_m(both, torch.float32, H, I) == (16, "cached") and len(rows) == 10
    cpu_experts.choose_small_m(both, torch.float32, H, 2 * I)  # other shapes: measured again
    assert len(rows) == 20
    # One layout in the plan: nothing to measure.
    assert cpu_experts.choose_small_m(PLANS["panels"], torch.float32, H, I) == (NEVER, "test")
    assert cpu_experts.choose_small_m(PLANS["onednn"], torch.float32, H, I) == (0, "test")

    layer = _experts(4, H, I, torch.float32, seed=2)
    assert cpu_experts.pack_experts(torch.nn.ModuleList([layer]), both) == (1, 16)
    packed = cpu_experts._PACKED[layer.w13.data_ptr()]
    assert packed.w13_panels is not None and len(packed.onednn("w13")) == 4
    for small_m in (NEVER, 0):
        cpu_experts.pack_experts(torch.nn.ModuleList([layer]), both, small_m)
        packed = cpu_experts._PACKED[layer.w13.data_ptr()]
        assert (packed.w13_panels is not None, bool(packed.onednn("w2"))) == (small_m == NEVER, small_m == 0)
