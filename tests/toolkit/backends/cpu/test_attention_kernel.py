"""The CPU attention kernels (csrc/attention.cpp) against dense float64 attention and the torch write.

The batches are the reference's (tests/attention/batches.py): shuffled block ids and garbage in every
slot a request does not own, including the tail rows of each request's last block, which the kernel
computes and must ignore. Every step kind is one call: prefill chunks, decodes and padding rows mixed.
"""

import random

import pytest
import torch

from toolkit.attention import AttentionMetadata, paged_attention, write_kv
from tests.attention.batches import HEAD_CONFIGS, dense_reference, make_batch, random_specs
from toolkit.backends.cpu import kernels


@pytest.fixture(scope="module", autouse=True)
def built():
    # Not a skip condition: a machine that runs the suite has the compiler torch.compile needs, so a
    # kernel that fails to build fails here.
    assert kernels.load() == {}


def attend(batch, q=None, seq_lens=None, tables=None, flash_min=0):
    m = batch.metadata
    return torch.ops.toolkit.paged_attention_cpu(batch.q if q is None else q, batch.kv_cache, m.query_start_loc,
                                                 m.seq_lens if seq_lens is None else seq_lens,
                                                 m.block_tables if tables is None else tables, batch.scale, flash_min)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_CONFIGS + [(12, 4)])
def test_every_step_kind_matches_dense(block_size, head_dim, num_heads, num_kv_heads):
    rng = random.Random(block_size * 1000 + head_dim * 10 + num_heads)
    for trial in range(3):
        specs = random_specs(rng, block_size, num_requests=rng.randint(1, 6))
        batch = make_batch(specs, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, num_pad=rng.randint(0, 3), seed=trial)
        out = attend(batch)
        assert out.shape == batch.q.shape and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), dense_reference(batch), atol=1e-5, rtol=1e-5, msg=f"specs {specs}")


@pytest.mark.parametrize("specs", [
    [(0, 1), (7, 1), (15, 1), (16, 1), (47, 1), (200, 1)],  # decodes of every length class
    [(0, 32), (16, 16)],  # a prefill of exactly two blocks; a chunk starting and ending on boundaries
    [(15, 2), (17, 1), (0, 0), (3, 0)],  # a chunk straddling a boundary, and requests with no new token
])
def test_edge_batches_and_padding_rows(specs):
    batch = make_batch(specs, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, num_pad=2)
    out = attend(batch)
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=1e-5, rtol=1e-5)
    assert not out[batch.num_tokens:].any()  # rows past the last request are zeros


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_CONFIGS + [(12, 4), (12, 2)])  # query heads per kv head: 1-8
@pytest.mark.parametrize("head_dim", [64, 72, 96])  # bf16 products and values 32 dims at a time (96: 64 + 32); 72: the widened path
def test_half_caches(dtype, tol, num_heads, num_kv_heads, head_dim):
    batch = make_batch([(40, 1), (0, 23), (17, 9)], block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, dtype=dtype)
    out = attend(batch)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_CONFIGS + [(12, 4), (12, 12)])
def test_prefill_chunks_in_tiles_match_dense(dtype, tol, num_heads, num_kv_heads):
    """Chunks of a tile's length or more go in tiles of 12-24 tokens per kv head (each token its own
    causal length): whole and partial tiles, over long cached contexts and none, beside decodes."""
    specs = [(100, 50), (0, 37), (33, 24), (5, 12), (0, 1), (70, 11), (16, 48)]
    batch = make_batch(specs, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                       dtype=dtype, num_pad=1)
    out = attend(batch)
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=tol, rtol=tol)
    assert not out[batch.num_tokens:].any()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_CONFIGS + [(9, 3)])
@pytest.mark.parametrize("flash_min", [2, 24])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_chunks_through_aten_flash_attention_match_dense(dtype, tol, num_heads, num_kv_heads, flash_min, head_dim):
    """Requests of flash_min+ new tokens go to ATen's flash attention on their gathered K/V: first chunks
    (one causal call) and chunks over a cached prefix (two calls merged by log-sum-exp), beside requests
    the tiles and per-token tasks keep, decodes, a request with no new token and padding rows. In bf16
    on AMX they go to the tiles instead (flash_on_amx, csrc/attention_amx.h: 32 tokens of one head a
    task, each seeing the positions up to its own; 50 new tokens over 100 cached ones end in a task of
    18, its second query tile of 2 rows, mid-32-position step; 12 new tokens fill part of one tile; 240
    over 2,040 cached run past 2,048 positions)."""
    specs = [(100, 50), (0, 37), (33, 24), (5, 12), (0, 1), (70, 2), (16, 48), (9, 0), (0, 2), (400, 40),
             (2040, 240)]
    batch = make_batch(specs, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       dtype=dtype, num_pad=2, seed=flash_min)
    out = attend(batch, flash_min=flash_min)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=tol, rtol=tol)
    assert not out[batch.num_tokens:].any()
    # As the model hands it q: a slice of a fused projection.
    fused = torch.cat([batch.q, torch.randn_like(batch.q)], dim=1)[:, :num_heads]
    torch.testing.assert_close(attend(batch, q=fused, flash_min=flash_min), out, atol=0, rtol=0)
    # Each request's blocks consecutive: read in place, not gathered.
    in_consecutive_blocks(batch)
    torch.testing.assert_close(attend(batch, flash_min=flash_min).double(), dense_reference(batch), atol=tol, rtol=tol)


def in_consecutive_blocks(batch):
    """The batch with each request's blocks consecutive in the cache (as a prompt's are when they were
    allocated together), which the flash path reads in place instead of gathering them."""
    block_size, tables = batch.kv_cache.shape[2], batch.metadata.block_tables
    cache = 100 * torch.randn_like(batch.kv_cache, dtype=torch.float32)
    next_block = 1
    for r, (k, v) in enumerate(zip(batch.keys, batch.values)):
        blocks = -(-len(k) // block_size)
        tables[r] = 0
        tables[r, :blocks] = torch.arange(next_block, next_block + blocks, dtype=torch.int32)
        for pos in range(len(k)):
            cache[0, next_block + pos // block_size, pos % block_size] = k[pos].float()
            cache[1, next_block + pos // block_size, pos % block_size] = v[pos].float()
        next_block += blocks
    batch.kv_cache = cache.to(batch.kv_cache.dtype)
    return batch


def share_leading_blocks(batch, requests, blocks):
    """Make `requests` (indices) begin with the first request's first `blocks` blocks, as prefix caching
    hands them out: their tables name those blocks, and their K/V there are the first request's."""
    lead, block_size = requests[0], batch.kv_cache.shape[2]
    for r in requests[1:]:
        batch.metadata.block_tables[r, :blocks] = batch.metadata.block_tables[lead, :blocks]
        for kv in (batch.keys, batch.values):
            kv[r][:blocks * block_size] = kv[lead][:blocks * block_size]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_CONFIGS + [(9, 3)])
@pytest.mark.parametrize("flash_min", [2, 4])
def test_decodes_sharing_a_prefix_in_a_cascade_match_dense(dtype, tol, num_heads, num_kv_heads, flash_min):
    """With flash_min > 0, max(flash_min, 2)+ decodes that begin with the same whole blocks attend to them
    together (ATen's flash kernel) and each to the rest alone, merged by log-sum-exp: here a group of 5
    sharing 3 blocks (one of them with only its own token past them), a group of 3 of which one leaves the
    shared blocks after 2 (the whole group shares 2; with flash_min 4 it is too small), beside a lone
    decode, a prefill chunk over shared blocks, and padding."""
    specs = [(48, 1), (52, 1), (63, 1), (64, 1), (90, 1), (50, 1), (70, 1), (33, 1), (100, 1), (30, 20)]
    batch = make_batch(specs, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                       dtype=dtype, num_pad=2, seed=flash_min)
    share_leading_blocks(batch, [0, 1, 2, 3, 4, 9], 3)
    share_leading_blocks(batch, [5, 6, 7], 2)
    share_leading_blocks(batch, [5, 6], 3)
    out = attend(batch, flash_min=flash_min)
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=tol, rtol=tol)
    assert not out[batch.num_tokens:].any()
    torch.testing.assert_close(out.double(), attend(batch).double(), atol=tol, rtol=tol)  # the tiles alone
    in_consecutive_blocks(batch)  # the shared blocks read in place
    share_leading_blocks(batch, [0, 1, 2, 3, 4, 9], 3)
    share_leading_blocks(batch, [5, 6, 7], 2)
    share_leading_blocks(batch, [5, 6], 3)
    torch.testing.assert_close(attend(batch, flash_min=flash_min).double(), dense_reference(batch), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (9, 3)])
@pytest.mark.parametrize("flash_min", [2, 16])
def test_chunks_and_decodes_sharing_a_prefix_in_a_cascade_match_dense(dtype, tol, num_heads, num_kv_heads, flash_min):
    """Prefill chunks over a shared cached prefix join the cascade too (many prompts after one system
    prompt): all the group's queries attend to the shared blocks in one flash call (in bf16 on AMX, the
    tiles: group A's 48 shared positions rounded down to 32, its over 64 vectors a kv head packed once for
    all tasks), each chunk to its own positions with flash_span, each decode with the tiles. Group A shares 3 blocks: chunks whose own
    part starts on a block boundary and mid-block (12 cached positions of their own first), decodes, and a
    5-token chunk that is a member only when flash_min is 2. Group B is two chunks sharing 2 blocks, one of
    them leaving the lead's blocks after 2 of its 3 cached ones. Beside them a first chunk, a lone decode
    and padding; then all of it again with each request's own blocks consecutive (read in place)."""
    specs = [(48, 20), (60, 17), (48, 1), (100, 1), (50, 30), (48, 5), (32, 16), (40, 24), (0, 37), (30, 1)]
    group_a, group_b = [0, 1, 2, 3, 4, 5], [6, 7]

    def shared(batch):
        share_leading_blocks(batch, group_a, 3)
        share_leading_blocks(batch, group_b, 2)
        return batch

    batch = shared(make_batch(specs, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                              dtype=dtype, num_pad=2, seed=flash_min))
    out = attend(batch, flash_min=flash_min)
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=tol, rtol=tol)
    assert not out[batch.num_tokens:].any()
    shared(in_consecutive_blocks(batch))
    torch.testing.assert_close(attend(batch, flash_min=flash_min).double(), dense_reference(batch), atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(12, 4), (4, 4)])
def test_a_cascade_of_decodes_on_the_tiles_matches_dense(head_dim, num_heads, num_kv_heads):
    """bf16 decodes over a shared prefix: where the CPU has AMX, the shared part goes to the tile unit
    (csrc/attention_amx.h) in steps of 32 positions (64 dims of the outputs at a time, 32 query vectors a
    call): 18 decodes sharing 5 blocks (80 positions: 64 through the tiles, 16 with each one's own), so
    a kv head's vectors fill one call and part of the next (12 query heads over 4 kv heads: 54 vectors,
    packed by the task itself; 4 over 4: 18); elsewhere ATen's kernel serves it."""
    specs = [(90 + 3 * i, 1) for i in range(18)] + [(40, 1), (0, 5)]
    batch = make_batch(specs, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       dtype=torch.bfloat16, num_pad=1, seed=head_dim)
    share_leading_blocks(batch, list(range(18)), 5)
    out = attend(batch, flash_min=16)
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=2e-2, rtol=2e-2)
    assert not out[batch.num_tokens:].any()


@pytest.mark.parametrize("block_size", [8, 16, 32, 48])
def test_the_tiles_pack_from_blocks_of_any_size(block_size):
    """bf16 on AMX: the tiles pack K/V straight from the cache's blocks where 16 positions from a multiple
    of 16 lie in one block (blocks of 16, 32, 48), a flash request's last partial 32 positions copied out
    with zero rows after them; with blocks of 8 every row is copied out first. Flash requests ending
    mid-block and mid-32 (45 and 103 positions; 32 exactly), and a cascade of decodes over 4 shared blocks
    (a multiple of 32 positions at every size here), scattered blocks and then consecutive ones.
    Elsewhere ATen's kernel serves them, against the same reference."""
    specs = [(0, 45), (70, 33), (0, 32)] + [(4 * block_size + 5 + 3 * i, 1) for i in range(6)]
    cascade = list(range(3, 9))
    batch = make_batch(specs, block_size=block_size, num_heads=12, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16,
                       num_pad=1, seed=block_size)
    share_leading_blocks(batch, cascade, 4)
    out = attend(batch, flash_min=16)
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=2e-2, rtol=2e-2)
    assert not out[batch.num_tokens:].any()
    share_leading_blocks(in_consecutive_blocks(batch), cascade, 4)
    torch.testing.assert_close(attend(batch, flash_min=16).double(), dense_reference(batch), atol=2e-2, rtol=2e-2)


def test_strided_q_as_the_model_slices_it():
    batch = make_batch([(7, 3), (30, 1)], block_size=16, num_heads=8, num_kv_heads=2, head_dim=64)
    fused = torch.cat([batch.q, torch.randn_like(batch.q)], dim=1)
    assert not fused[:, :8].is_contiguous()
    torch.testing.assert_close(attend(batch, q=fused[:, :8]).double(), dense_reference(batch), atol=1e-5, rtol=1e-5)


def test_bad_block_ids_and_lengths_raise_instead_of_reading_out_of_bounds():
    batch = make_batch([(9, 1), (30, 1)], block_size=16, num_heads=4, num_kv_heads=2, head_dim=64)
    m = batch.metadata
    num_blocks, width = batch.kv_cache.shape[1], m.block_tables.shape[1]
    tables = m.block_tables.clone()
    tables[1, 0] = num_blocks
    with pytest.raises(RuntimeError, match="block id outside"):
        attend(batch, tables=tables)
    with pytest.raises(RuntimeError, match="block id outside"):  # checked before the flash path gathers
        attend(batch, tables=tables, flash_min=1)
    with pytest.raises(RuntimeError, match="past their block table"):
        attend(batch, seq_lens=torch.tensor([10, width * 16 + 1], dtype=torch.int32))
    odd = make_batch([(9, 1)], block_size=12, num_heads=4, num_kv_heads=2, head_dim=64)
    with pytest.raises(RuntimeError, match="multiples of 8"):
        attend(odd)
    with pytest.raises(RuntimeError, match="dtype"):
        attend(batch, q=batch.q.to(torch.bfloat16))


@pytest.mark.parametrize("threads", [1, 2])
def test_per_token_and_per_kv_head_tasks_agree_with_dense(threads):
    """Few tokens for the thread count split each token's heads by kv head; enough tokens make one
    task per token. The kernel's OpenMP runtime is torch's, so torch's thread count decides."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for specs in ([(20, 1)], [(20, 1)] * 9, [(3, 12)]):
            batch = make_batch(specs, block_size=16, num_heads=12, num_kv_heads=4, head_dim=64, seed=threads)
            torch.testing.assert_close(attend(batch).double(), dense_reference(batch), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_write_kv_writes_what_the_torch_backend_writes():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(2, 6, 16, 2, 64, generator=gen).to(dtype)
        slots = torch.tensor([37, -1, 0, 95, 16, -1, 50], dtype=torch.int64)
        fused = torch.randn(len(slots), 6, 64, generator=gen).to(dtype)  # k, v sliced from a fused projection
        k, v = fused[:, 2:4], fused[:, 4:]
        expected = cache.clone()
        write_kv(k, v, expected, slots, backend="torch")
        torch.ops.toolkit.write_kv_cpu(k, v, cache, slots)
        assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.toolkit.write_kv_cpu(k, v, cache, torch.tensor([0, 1, 2, 3, 4, 5, 6 * 16], dtype=torch.int64))


def test_compiled_step_calls_the_kernels_in_place():
    """As the model uses them: write the new K/V, then attend, in one graph. The write reaches the
    caller's cache without a copy of it."""
    from torch._inductor.utils import run_and_get_code  # imports triton: keep it out of collection

    from toolkit.backends.cpu import register_attention

    register_attention()
    batch = make_batch([(20, 1), (0, 5), (9, 12)], block_size=16, num_heads=4, num_kv_heads=2, head_dim=64)
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, batch.q.shape[0], 2, 64, generator=gen)
    meta = AttentionMetadata(batch.metadata.query_start_loc, batch.metadata.seq_lens, batch.metadata.block_tables,
                             batch.metadata.slot_mapping, backend="cpu")

    def step(q, k, v, kv_cache, metadata):
        write_kv(k, v, kv_cache, metadata.slot_mapping, backend=metadata.backend)
        return paged_attention(q * 1.0, kv_cache, metadata, 0.125) + 1.0

    expected_cache = batch.kv_cache.clone()
    expected = step(batch.q, k, v, expected_cache, meta)
    cache = batch.kv_cache.clone()
    out, codes = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=True), batch.q, k, v, cache, meta)
    assert torch.equal(cache, expected_cache)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    code = "\n".join(codes)
    assert "toolkit.paged_attention_cpu" in code and "toolkit.write_kv_cpu" in code
    assert "clone" not in code and f"{cache.numel()}L" not in code, "the cache was copied, not written in place"


def test_loading_the_kernels_keeps_subnormal_floats():
    """Built with -ffast-math, but not linked with it: loading must not set flush-to-zero for the
    whole process (it once made an unrelated hypothesis test fail)."""
    tiny = torch.tensor([1e-39])  # subnormal in float32
    assert (tiny * 1.0).item() != 0.0
