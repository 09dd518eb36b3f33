"""The Triton MoE kernel (toolkit/moe/triton_moe.py) against a naive torch oracle of the contract.

By default the kernel runs on CPU under the Triton interpreter (TRITON_INTERPRET=1), so shapes are
tiny. Set TOOLKIT_TEST_DEVICE=cuda to run the same checks with compiled kernels on a GPU.

The oracle is a loop over (token, slot) pairs in float64, independent of the toolkit's own MoE op:
out[t] = sum_j w[t, j] * (silu(x_t @ gate_e^T) * (x_t @ up_e^T)) @ down_e^T, e = id - first_expert,
for e in [0, E_local) only. Where toolkit/moe/ops.py exists, its op is compared too.
"""


from tests.triton_interpreter import (  # noqa: I001  first: sets TRITON_INTERPRET before triton loads
    DEVICE, NEEDS_FRESH_PROCESS, run_module_in_fresh_process, skip_unless_here)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from toolkit.moe.triton_moe import fused_experts_triton, moe_align_block_size  # noqa: E402

MIN_PASSED_IN_CHILD = 20  # the fresh process must really run the kernels


@pytest.fixture(autouse=True)
def run_here_or_in_fresh_process(request):
    skip_unless_here(request)


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the kernels were tested in this process")
def test_module_in_fresh_process():
    """This whole module, in a new interpreter where TRITON_INTERPRET is set before triton loads."""
    run_module_in_fresh_process(__file__, min_passed=MIN_PASSED_IN_CHILD, timeout=600)


# ---------------------------------------------------------------------------------------------
# Inputs and the oracle


def make_experts(num_tokens, hidden, inter, num_local, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_local, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_local, hidden, inter, generator=g) / inter**0.5
    return x.to(dtype).to(DEVICE), w13.to(dtype).to(DEVICE), w2.to(dtype).to(DEVICE)


def routing(kind, num_tokens, top_k, num_global, seed=0):
    """(topk_weights float32, topk_ids int64) [T, k]: distinct experts per token, like a router's top-k."""
    g = torch.Generator().manual_seed(seed + 100)
    scores = torch.rand(num_tokens, num_global, generator=g)
    if kind == "skewed":  # every token's first choice is expert 2
        scores[:, 2] = 2.0
    elif kind == "empty":  # experts 1 and 4 get nothing
        scores[:, [1, 4]] = -1.0
    ids = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(DEVICE), ids.to(DEVICE)


def oracle(x, w13, w2, topk_weights, topk_ids, first_expert=0):
    """The contract, one (token, slot) pair at a time, in float64."""
    num_local, two_inter, _ = w13.shape
    inter = two_inter // 2
    x, w13, w2 = x.double().cpu(), w13.double().cpu(), w2.double().cpu()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j]) - first_expert
            if not 0 <= e < num_local:
                continue
            h = F.silu(x[t] @ w13[e, :inter].T) * (x[t] @ w13[e, inter:].T)
            out[t] += float(topk_weights[t, j].float()) * (h @ w2[e].T)
    return out


# ---------------------------------------------------------------------------------------------
# The align step alone


def check_align(topk_ids, block_m, num_local, first_expert):
    sorted_ids, expert_ids, num_rows = moe_align_block_size(topk_ids, block_m, num_local, first_expert)
    flat = (topk_ids.reshape(-1) - first_expert).cpu()
    sorted_ids, expert_ids, num_rows = sorted_ids.cpu(), expert_ids.cpu(), int(num_rows.item())
    num_pairs = flat.numel()
    sentinel = num_pairs
    local = [p for p in range(num_pairs) if 0 <= int(flat[p]) < num_local]
    counts = [sum(1 for p in local if int(flat[p]) == e) for e in range(num_local)]
    max_rows = num_pairs + min(num_local, num_pairs) * (block_m - 1)

    assert sorted_ids.dtype == expert_ids.dtype == torch.int64
    assert sorted_ids.numel() % block_m == 0 and max_rows <= sorted_ids.numel() < max_rows + block_m
    assert expert_ids.numel() == sorted_ids.numel() // block_m
    assert num_rows == sum(-(-c // block_m) * block_m for c in counts) and num_rows % block_m == 0
    # Every local (token, slot) pair exactly once, nothing else but the sentinel.
    real = sorted_ids[sorted_ids != sentinel].tolist()
    assert sorted(real) == local
    assert (sorted_ids[num_rows:] == sentinel).all()
    num_blocks = num_rows // block_m
    assert (expert_ids[num_blocks:] == -1).all()
    blocks_per_expert = [0] * num_local
    for b in range(num_blocks):
        e = int(expert_ids[b])
        assert 0 <= e < num_local
        block = sorted_ids[b * block_m : (b + 1) * block_m].tolist()
        members = [p for p in block if p != sentinel]
        assert members, f"block {b} holds only padding"
        assert all(int(flat[p]) == e for p in members), f"block {b} mixes experts"
        # Padding only at the end of an expert's run; pairs keep their order within the expert.
        assert block[: len(members)] == members
        blocks_per_expert[e] += 1
    assert expert_ids[:num_blocks].tolist() == sorted(expert_ids[:num_blocks].tolist())
    assert blocks_per_expert == [-(-c // block_m) for c in counts]  # empty experts get no block
    for e in range(num_local):
        rows = [p for p in sorted_ids[:num_rows].tolist() if p != sentinel and int(flat[p]) == e]
        assert rows == [p for p in local if int(flat[p]) == e]
    return num_rows


@pytest.mark.parametrize("kind", ["random", "empty", "skewed"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("block_m", [4, 16])
def test_align_block_size(kind, top_k, block_m):
    _, ids = routing(kind, 23, top_k, 6, seed=block_m + top_k)
    check_align(ids, block_m, 6, 0)


def test_align_block_size_expert_parallel():
    # 8 global experts; this rank holds 3..5: the other pairs are left out, their tokens too.
    _, ids = routing("random", 19, 2, 8, seed=7)
    assert ((ids < 3) | (ids >= 6)).any() and ((ids >= 3) & (ids < 6)).any()
    check_align(ids, 4, 3, 3)
    ids_none_local = torch.tensor([[0, 1], [7, 6]], device=DEVICE)
    assert check_align(ids_none_local, 16, 3, 3) == 0


def test_align_block_size_edges():
    ids = torch.tensor([[5]], device=DEVICE)  # one decode token
    assert check_align(ids, 16, 8, 0) == 16
    sorted_ids, expert_ids, _ = moe_align_block_size(ids, 16, 8)
    assert sorted_ids.numel() == 16 and expert_ids.tolist() == [5]  # the bound is min(E, P) blocks
    assert check_align(torch.zeros(0, 2, dtype=torch.int64, device=DEVICE), 16, 4, 0) == 0
    # Exactly a multiple of block_m per expert: no padding at all.
    ids = torch.tensor([[0], [0], [0], [0], [1], [1], [1], [1]], device=DEVICE)
    assert check_align(ids, 4, 2, 0) == 8


# ---------------------------------------------------------------------------------------------
# The fused kernel against the oracle

SMALL = (16, 16, 16)  # BLOCK_M, N, K: several row blocks, column tiles and K steps on tiny shapes

# (T, H, I, E_local, E_global, first_expert, k, routing kind, block sizes)
CASES = {
    "random_k2_odd_T": (13, 32, 16, 4, 4, 0, 2, "random", SMALL),
    "empty_experts": (21, 32, 16, 6, 6, 0, 2, "empty", SMALL),
    "k1": (7, 32, 16, 4, 4, 0, 1, "random", SMALL),
    "skewed_k1_many_blocks": (37, 32, 16, 4, 4, 0, 1, "skewed", SMALL),
    "skewed_k2": (19, 32, 16, 4, 4, 0, 2, "skewed", SMALL),
    "expert_parallel": (17, 32, 16, 3, 8, 3, 2, "random", SMALL),
    "expert_parallel_last_rank": (11, 32, 16, 2, 8, 6, 2, "random", SMALL),
    "odd_dims_masked_tiles": (9, 40, 24, 3, 3, 0, 2, "random", SMALL),
    "decode_one_token": (1, 32, 16, 4, 4, 0, 2, "random", None),
    "default_block_sizes": (13, 40, 24, 4, 4, 0, 2, "random", None),
    "default_block_sizes_64_rows": (40, 32, 16, 2, 2, 0, 2, "random", None),  # P > 16 * E: BLOCK_M 64
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_experts_float32_matches_oracle(case):
    t, h, i, e_local, e_global, first, top_k, kind, blocks = CASES[case]
    x, w13, w2 = make_experts(t, h, i, e_local, seed=len(case))
    weights, ids = routing(kind, t, top_k, e_global, seed=t)
    out = fused_experts_triton(x, w13, w2, weights, ids, first, block_sizes=blocks)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    expected = oracle(x, w13, w2, weights, ids, first)
    assert expected.abs().max() > 0.1  # the check is not vacuous
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=1e-4)
    if first > 0 or e_local < e_global:  # tokens with no local expert are exact zeros
        no_local = ~((ids >= first) & (ids < first + e_local)).any(-1)
        assert not out[no_local].any()


def test_no_local_expert_and_no_tokens():
    x, w13, w2 = make_experts(5, 32, 16, 2)
    weights, _ = routing("random", 5, 2, 8)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [0, 7]], device=DEVICE)
    assert torch.equal(fused_experts_triton(x, w13, w2, weights, ids, first_expert=2 + 6), torch.zeros_like(x))
    empty = fused_experts_triton(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 32)


def test_same_expert_twice_sums():
    # Not what a top-k router emits, but the contract sums slots: two slots on one expert add up.
    x, w13, w2 = make_experts(6, 32, 16, 3, seed=3)
    weights, _ = routing("random", 6, 2, 3)
    ids = torch.tensor([[1, 1], [0, 2], [2, 2], [0, 0], [1, 2], [1, 0]], device=DEVICE)
    out = fused_experts_triton(x, w13, w2, weights, ids, block_sizes=SMALL)
    torch.testing.assert_close(out.cpu().double(), oracle(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


def test_strided_inputs():
    # x and the weights as strided views, topk_weights transposed in memory, int32 ids.
    x_wide, w13, w2 = make_experts(10, 64, 16, 4, seed=5)
    x = x_wide[:, 16:48]
    w13 = w13[:, :, 16:48]  # a non-contiguous weight view is honoured through its strides
    w2 = w2[:, 16:48, :]
    weights, ids = routing("random", 10, 2, 4, seed=5)
    out = fused_experts_triton(x, w13, w2, weights.t().contiguous().t(), ids.to(torch.int32), block_sizes=SMALL)
    torch.testing.assert_close(out.cpu().double(), oracle(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


def test_rejects_mismatched_shapes_and_dtypes():
    x, w13, w2 = make_experts(4, 32, 16, 2)
    weights, ids = routing("random", 4, 2, 2)
    with pytest.raises(ValueError, match="expert weights"):
        fused_experts_triton(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="dtype"):
        fused_experts_triton(x.double(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_experts_triton(x, w13, w2, weights[:, :1], ids)


# ---------------------------------------------------------------------------------------------
# 16-bit inputs


@triton.jit
def _dot_probe_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    idx = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(c_ptr + idx, tl.dot(tl.load(a_ptr + idx), tl.load(b_ptr + idx)))


def _bf16_dot_works() -> bool:
    """Whether tl.dot in bfloat16 gives right answers here (the interpreter of triton 3.x keeps bf16 as
    uint16 and multiplies the raw bits, triton#11584; compiled kernels on a GPU are fine)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    c = torch.empty(16, 16, dtype=torch.float32, device=DEVICE)
    _dot_probe_kernel[(1,)](a, b, c, N=16)
    return torch.allclose(c.cpu(), a.float().cpu() @ b.float().cpu(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["random_k2_odd_T", "expert_parallel"])
def test_fused_experts_half_precision(dtype, case):
    if dtype == torch.bfloat16 and not _bf16_dot_works():
        pytest.skip("tl.dot in bfloat16 is wrong in this Triton interpreter (triton#11584); checked on a GPU")
    t, h, i, e_local, e_global, first, top_k, kind, blocks = CASES[case]
    x, w13, w2 = make_experts(t, h, i, e_local, dtype=dtype, seed=11)
    weights, ids = routing(kind, t, top_k, e_global, seed=t)
    out = fused_experts_triton(x, w13, w2, weights, ids, first, block_sizes=blocks)
    assert out.dtype == dtype
    # The oracle sees the same rounded inputs; the kernel also rounds the activation to 16 bits.
    expected = oracle(x, w13, w2, weights, ids, first)
    torch.testing.assert_close(out.cpu().double(), expected, atol=3e-2, rtol=3e-2)


# ---------------------------------------------------------------------------------------------
# The toolkit's own op, where it exists (toolkit/moe/ops.py, written alongside this kernel)


def _toolkit_reference():
    try:
        from toolkit.moe.ops import moe_experts_torch
    except ImportError as exc:
        pytest.skip(f"toolkit.moe.ops is not importable yet: {exc}")
    return moe_experts_torch


@pytest.mark.parametrize("case", list(CASES))
def test_matches_toolkit_reference(case):
    reference = _toolkit_reference()
    t, h, i, e_local, e_global, first, top_k, kind, blocks = CASES[case]
    x, w13, w2 = make_experts(t, h, i, e_local, seed=21)
    weights, ids = routing(kind, t, top_k, e_global, seed=t)
    expected = reference(x, w13, w2, weights, ids, first)
    out = fused_experts_triton(x, w13, w2, weights, ids, first, block_sizes=blocks)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_matches_toolkit_reference_float16():
    reference = _toolkit_reference()
    x, w13, w2 = make_experts(13, 32, 16, 6, dtype=torch.float16, seed=22)
    weights, ids = routing("empty", 13, 2, 6, seed=3)
    expected = reference(x, w13, w2, weights, ids)
    out = fused_experts_triton(x, w13, w2, weights, ids, block_sizes=SMALL)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_toolkit_op_on_this_device():
    # On CPU the op runs the reference; on CUDA it runs this kernel (impl_for), so this checks the wiring.
    _toolkit_reference()
    from toolkit.moe.ops import impl_for, moe_experts

    if DEVICE == "cuda":
        assert impl_for(torch.device("cuda")) is fused_experts_triton
    x, w13, w2 = make_experts(9, 32, 16, 3, seed=23)
    weights, ids = routing("random", 9, 2, 8, seed=4)
    counts = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    out = moe_experts(x, w13, w2, weights, ids, 3, counts)
    torch.testing.assert_close(out.cpu().double(), oracle(x, w13, w2, weights, ids, 3), atol=1e-4, rtol=1e-4)
    assert counts.sum() == ((ids >= 3) & (ids < 6)).sum()


# ---------------------------------------------------------------------------------------------
# End to end: the engine with this kernel serving the experts gives transformers' greedy tokens


def test_engine_with_triton_experts_matches_transformers(tmp_path, one_torch_thread):
    from toolkit.config import SUPPORTED_ARCHITECTURES

    if "Qwen2MoeForCausalLM" not in SUPPORTED_ARCHITECTURES:
        pytest.skip("the toolkit does not serve Qwen2-MoE yet")
    import transformers

    from tests.checkpoints import hf_greedy, random_prompts
    from toolkit import LLM, SamplingParams
    from toolkit.moe import ops

    # Qwen2-MoE: routed experts (top-2 of 6, not renormalized) beside the gated shared expert.
    config = transformers.Qwen2MoeConfig(
        vocab_size=384, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        moe_intermediate_size=48, shared_expert_intermediate_size=96, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=False, intermediate_size=96)
    torch.manual_seed(1)
    transformers.Qwen2MoeForCausalLM(config).eval().save_pretrained(tmp_path, safe_serialization=True)
    prompts = random_prompts(3, seed=4, low=3, high=20)
    expected = hf_greedy(tmp_path, prompts, 6)

    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return fused_experts_triton(*args)

    ops.register_impl(DEVICE, counted)
    try:
        llm = LLM(str(tmp_path), dtype="float32", enforce_eager=True, max_model_len=64, device=DEVICE)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    finally:
        ops.register_impl(DEVICE, None)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert calls and max(calls) > 1  # the kernel served prefill and decode steps
