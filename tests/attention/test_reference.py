"""The torch reference of the attention ops against plain dense causal attention.

Each case builds a random paged batch (tests/attention/batches.py: shuffled, non-contiguous block ids,
garbage in every slot a request does not own), runs paged_attention, and compares every request
with dense attention over its full K/V computed in float64.
"""

import random

import pytest
import torch

from toolkit.attention import (
    AttentionMetadata,
    allocate_kv_cache,
    available_memory_bytes,
    kv_cache_bytes_per_token,
    num_blocks_for_budget,
    paged_attention,
    write_kv,
)
from tests.attention.batches import HEAD_CONFIGS, Batch, dense_reference, make_batch, random_specs


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_CONFIGS)
def test_paged_attention_matches_dense(block_size, head_dim, num_heads, num_kv_heads):
    rng = random.Random(block_size * 1000 + head_dim * 10 + num_kv_heads)
    for trial in range(3):
        specs = random_specs(rng, block_size, num_requests=rng.randint(1, 6))
        batch = make_batch(
            specs, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, num_pad=rng.randint(0, 3), seed=trial,
        )
        out = paged_attention(batch.q, batch.kv_cache, batch.metadata, batch.scale)
        assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
        torch.testing.assert_close(out.double(), dense_reference(batch), atol=1e-5, rtol=1e-5, msg=f"specs {specs}")


@pytest.mark.parametrize(
    "specs",
    [
        [(0, 1)],  # a decode with an empty context: attends to itself only
        [(5, 1), (16, 1), (31, 1), (0, 1)],  # decodes only, one right on a block boundary
        [(0, 32)],  # a prefill of exactly two blocks
        [(16, 16)],  # a chunk starting and ending on block boundaries
        [(15, 2), (17, 1), (0, 0), (3, 0)],  # a chunk straddling a boundary, and empty requests
    ],
)
def test_edge_batches(specs):
    batch = make_batch(specs, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, num_pad=2)
    out = paged_attention(batch.q, batch.kv_cache, batch.metadata, batch.scale)
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=1e-5, rtol=1e-5)


def test_padding_rows_are_zero_and_do_not_matter():
    batch = make_batch([(3, 4), (20, 1)], block_size=16, num_heads=4, num_kv_heads=1, head_dim=64, num_pad=5)
    out = paged_attention(batch.q, batch.kv_cache, batch.metadata, batch.scale)
    assert torch.equal(out[batch.num_tokens :], torch.zeros_like(out[batch.num_tokens :]))
    batch.q[batch.num_tokens :] = 1e4  # changing the padding queries changes nothing
    again = paged_attention(batch.q, batch.kv_cache, batch.metadata, batch.scale)
    assert torch.equal(out, again)


def test_non_contiguous_q():
    # The model slices q out of a fused qkv projection, so q's token stride is larger than Hq * D.
    batch = make_batch([(7, 3), (30, 1)], block_size=16, num_heads=8, num_kv_heads=2, head_dim=64)
    fused = torch.cat([batch.q, torch.randn_like(batch.q)], dim=1)
    q = fused[:, :8]
    assert not q.is_contiguous()
    out = paged_attention(q, batch.kv_cache, batch.metadata, batch.scale)
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_float64():
    specs = [(40, 1), (0, 23), (17, 9)]
    batch = make_batch(specs, block_size=16, num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    out = paged_attention(batch.q, batch.kv_cache, batch.metadata, batch.scale)
    assert out.dtype == torch.bfloat16
    # Inputs are exactly representable; the error is bf16 rounding of probabilities/output only.
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=2e-2, rtol=2e-2)


def test_q_len_longer_than_seq_len_is_rejected():
    batch = make_batch([(0, 4)], block_size=16, num_heads=4, num_kv_heads=4, head_dim=64)
    batch.metadata.seq_lens[0] = 3
    with pytest.raises(ValueError, match="q_len"):
        paged_attention(batch.q, batch.kv_cache, batch.metadata, batch.scale)


def test_unknown_backend_is_rejected():
    batch = make_batch([(0, 2)], block_size=16, num_heads=4, num_kv_heads=4, head_dim=64)
    batch.metadata.backend = "cuda-magic"
    with pytest.raises(ValueError, match="backend"):
        paged_attention(batch.q, batch.kv_cache, batch.metadata, batch.scale)


# ---- write_kv -------------------------------------------------------------------------------------


def test_write_kv_writes_exactly_the_given_slots():
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, hkv, d = 6, 16, 2, 64
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen)
    before = cache.clone()
    slots = torch.tensor([37, -1, 0, 95, 16, -1, 50], dtype=torch.int64)
    # k, v as slices of a fused projection: non-contiguous, like the model produces them.
    fused = torch.randn(len(slots), 3 * hkv, d, generator=gen)
    k, v = fused[:, hkv : 2 * hkv], fused[:, 2 * hkv :]
    write_kv(k, v, cache, slots)

    expected = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0, slot // block_size, slot % block_size] = k[t]
            expected[1, slot // block_size, slot % block_size] = v[t]
    assert torch.equal(cache, expected)  # the given slots hold k/v; every other slot is untouched


@pytest.mark.parametrize("compiled", [False, True])
def test_traced_write_kv_matches_the_op_and_skips_tail_padding(compiled):
    """write_torch.py (what compiled torch-backend steps trace): the same cache as the op, padding rows
    (-1, after the real tokens) leave every slot but the real ones untouched."""
    from toolkit.attention.write_torch import write_kv_traced

    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 6, 16, 2, 64, generator=gen)
    slots = torch.tensor([37, 0, 95, 16, -1, -1], dtype=torch.int64)
    k, v = torch.randn(2, len(slots), 2, 64, generator=gen)
    expected = cache.clone()
    write_kv(k, v, expected, slots)  # eager: the op
    fn = torch.compile(write_kv_traced, fullgraph=True, dynamic=True) if compiled else write_kv_traced
    fn(k, v, cache, slots)
    assert torch.equal(cache, expected)


def test_write_kv_then_attention_over_chunks():
    """The engine's flow: a prompt prefilled in two chunks, then a decode, each step writing its KV first."""
    gen = torch.Generator().manual_seed(1)
    block_size, hq, hkv, d = 16, 4, 2, 64
    cache = torch.zeros(2, 8, block_size, hkv, d)
    table = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32)
    total = 40
    k_all, v_all = torch.randn(2, total, hkv, d, generator=gen)
    q_all = torch.randn(total, hq, d, generator=gen)
    outputs = []
    for start, end in [(0, 21), (21, 39), (39, 40)]:
        pos = torch.arange(start, end)
        slots = table[0, pos // block_size].long() * block_size + pos % block_size
        meta = AttentionMetadata(
            torch.tensor([0, end - start], dtype=torch.int32), torch.tensor([end], dtype=torch.int32), table, slots
        )
        write_kv(k_all[start:end], v_all[start:end], cache, slots)
        outputs.append(paged_attention(q_all[start:end], cache, meta, d**-0.5))
    dense = Batch(q_all, None, None, [k_all], [v_all], [(0, total)], total, d**-0.5)
    torch.testing.assert_close(torch.cat(outputs).double(), dense_reference(dense), atol=1e-5, rtol=1e-5)


# ---- torch.compile --------------------------------------------------------------------------------


def test_compiled_step_matches_eager_without_graph_breaks():
    from torch._inductor.utils import run_and_get_code  # imports triton: keep it out of collection

    specs = [(20, 1), (0, 5), (9, 12)]
    batch = make_batch(specs, block_size=16, num_heads=4, num_kv_heads=2, head_dim=64, num_pad=3)
    gen = torch.Generator().manual_seed(3)
    k_new = torch.randn(batch.q.shape[0], 2, 64, generator=gen)
    v_new = torch.randn(batch.q.shape[0], 2, 64, generator=gen)

    def step(q, k, v, kv_cache, metadata):
        write_kv(k, v, kv_cache, metadata.slot_mapping)
        return paged_attention(q * 1.0, kv_cache, metadata, 0.125) + 1.0  # ops around the custom ops too

    eager_cache = batch.kv_cache.clone()
    eager = step(batch.q, k_new, v_new, eager_cache, batch.metadata)
    compiled_cache = batch.kv_cache.clone()
    compiled_step = torch.compile(step, fullgraph=True)  # fullgraph: any graph break raises
    compiled, codes = run_and_get_code(compiled_step, batch.q, k_new, v_new, compiled_cache, batch.metadata)
    assert torch.equal(compiled_cache, eager_cache)  # the in-place write reached the caller's cache
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)
    # The torch backend traces the write (write_torch.py), and it must stay in place: a clone or a
    # copy-back would move the whole KV cache of a layer on every step, a loop over all its elements.
    code = "\n".join(codes)
    assert "torch.ops.toolkit.write_kv.default(" not in code
    assert "clone" not in code
    for n in (batch.kv_cache.numel(), batch.kv_cache.numel() // 2):
        assert f"{n}L" not in code, f"a loop over {n} cache elements: the write was not in place"


@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traced_decode_attention_matches_dense(num_heads, num_kv_heads, dtype):
    """decode_torch.py (the compiled CPU decode path), called eagerly, over decodes of every length
    class: empty context, inside a block, on a block boundary, several blocks."""
    from toolkit.attention.decode_torch import decode_attention_torch

    specs = [(0, 1), (7, 1), (15, 1), (16, 1), (47, 1), (3, 1)]
    batch = make_batch(specs, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64, dtype=dtype)
    m = batch.metadata
    out = decode_attention_torch(batch.q, batch.kv_cache, m.seq_lens, m.block_tables, batch.scale)
    assert out.shape == batch.q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=tol, rtol=tol)


# ---- sizing ---------------------------------------------------------------------------------------


def test_kv_cache_sizing():
    # Llama-3-8B's published figure: 128 KiB of K and V per token in bf16 (32 layers, 8 kv heads of 128).
    assert kv_cache_bytes_per_token(32, 8, 128, torch.bfloat16) == 128 * 1024
    kw = dict(num_layers=2, block_size=16, num_kv_heads=1, head_dim=64, dtype=torch.float32)
    block = 16 * kv_cache_bytes_per_token(2, 1, 64, torch.float32)
    # Only whole blocks count; a budget below one block holds none.
    assert num_blocks_for_budget(10 * block, **kw) == 10
    assert num_blocks_for_budget(11 * block - 1, **kw) == 10
    assert num_blocks_for_budget(block - 1, **kw) == 0
    assert num_blocks_for_budget(-5, **kw) == 0


def test_allocate_kv_cache_layout():
    caches = allocate_kv_cache(
        3, num_blocks=5, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device="cpu"
    )
    assert len(caches) == 3
    assert len({c.data_ptr() for c in caches}) == 3  # separate storage per layer
    for c in caches:
        assert c.shape == (2, 5, 16, 2, 64) and c.dtype == torch.bfloat16 and c.is_contiguous()
        assert not c.any()
    per_token = kv_cache_bytes_per_token(3, 2, 64, torch.bfloat16)
    assert sum(c.numel() * c.element_size() for c in caches) == per_token * 5 * 16


def test_available_memory_bytes_cpu():
    free = available_memory_bytes("cpu")
    with open("/proc/meminfo") as f:
        total_kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    assert 0 < free <= total_kb * 1024
