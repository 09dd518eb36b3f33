"""The CPU decode kernel (attention/paged_decode_cpu.cpp) against dense attention, and its build.

The batches are test_attention's: shuffled block ids and garbage in every slot a request does not
own, including the tail rows of each request's last block, which the kernel computes and must ignore.
"""

import ctypes

import pytest
import torch

from attention import cpp_build, decode_cpu, paged_attention
from tests.test_attention import HEAD_CONFIGS, dense_reference, make_batch


# Every length class: empty context, inside a block, on a boundary, several blocks, a long row.
DECODES = [(0, 1), (7, 1), (15, 1), (16, 1), (47, 1), (3, 1), (200, 1)]


def _decode(batch):
    m = batch.metadata
    return decode_cpu.paged_decode_cpu(batch.q, batch.kv_cache, m.seq_lens, m.block_tables, batch.scale)


def test_kernel_is_available_here():
    """Not a skip condition: a machine that runs the suite has the compiler torch.compile needs."""
    assert decode_cpu.kernel_available()


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_CONFIGS + [(12, 4)])
def test_kernel_matches_dense(block_size, head_dim, num_heads, num_kv_heads):
    batch = make_batch(DECODES, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    out = _decode(batch)
    assert out.shape == batch.q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_kernel_half_cache(dtype, tol):
    batch = make_batch(DECODES, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype)
    out = _decode(batch)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=tol, rtol=tol)


def test_zero_length_row_gives_zeros_and_non_contiguous_q_is_read_right():
    batch = make_batch([(9, 1), (30, 1)], block_size=16, num_heads=4, num_kv_heads=2, head_dim=64)
    wide = torch.randn(2, 4, 3 * 64)
    wide[..., 64:128] = batch.q  # q as a strided view, the way the model's q/k/v split hands it over
    m = batch.metadata
    seq_lens = torch.tensor([0, 31], dtype=torch.int32)
    out = decode_cpu.paged_decode_cpu(wide[..., 64:128], batch.kv_cache, seq_lens, m.block_tables, batch.scale)
    assert not out[0].any()
    torch.testing.assert_close(out[1].double(), dense_reference(batch)[1], atol=1e-5, rtol=1e-5)


def test_bad_block_ids_and_lengths_raise_instead_of_reading_out_of_bounds():
    batch = make_batch([(9, 1), (30, 1)], block_size=16, num_heads=4, num_kv_heads=2, head_dim=64)
    m = batch.metadata
    num_blocks, width = batch.kv_cache.shape[1], m.block_tables.shape[1]
    tables = m.block_tables.clone()
    tables[1, 0] = num_blocks
    with pytest.raises(IndexError, match="outside"):
        decode_cpu.paged_decode_cpu(batch.q, batch.kv_cache, m.seq_lens, tables, batch.scale)
    too_long = torch.tensor([10, width * 16 + 1], dtype=torch.int32)
    with pytest.raises(IndexError, match="past their block table"):
        decode_cpu.paged_decode_cpu(batch.q, batch.kv_cache, too_long, m.block_tables, batch.scale)
    odd = make_batch([(9, 1)], block_size=12, num_heads=4, num_kv_heads=2, head_dim=64)
    assert not decode_cpu.supports(odd.q, odd.kv_cache)  # paged_attention takes the torch path for it
    with pytest.raises(ValueError, match="multiples of 8"):
        decode_cpu.paged_decode_cpu(odd.q, odd.kv_cache, odd.metadata.seq_lens, odd.metadata.block_tables, odd.scale)


@pytest.mark.parametrize("kernel", [True, False])
def test_compiled_decode_only_step(kernel, monkeypatch):
    """A decode_only step under torch.compile calls the kernel as one opaque op; without it, it traces
    decode_torch.py into the graph. Both match the reference op, as one graph."""
    from torch._inductor.utils import run_and_get_code  # imports triton: keep it out of collection

    # As the model runner does: availability is settled before tracing, where it is a constant.
    if kernel:
        assert decode_cpu.kernel_available()
    else:
        monkeypatch.setattr(decode_cpu, "_available", False)
    torch._dynamo.reset()
    batch = make_batch([(20, 1), (0, 1), (33, 1)], block_size=16, num_heads=8, num_kv_heads=2, head_dim=64)
    meta = batch.metadata
    eager = paged_attention(batch.q, batch.kv_cache, meta, batch.scale)  # decode_only is False: the reference op
    meta.decode_only = True
    compiled_fn = torch.compile(lambda q, kv, m: paged_attention(q, kv, m, batch.scale), fullgraph=True)
    compiled, codes = run_and_get_code(compiled_fn, batch.q, batch.kv_cache, meta)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    code = "\n".join(codes)
    assert "toolkit.paged_attention" not in code
    assert ("toolkit.paged_decode_cpu" in code) == kernel


def test_build_is_cached_per_source_and_reports_a_missing_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    first = decode_cpu.build()
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert decode_cpu.build() == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary files left behind
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        decode_cpu.build(compiler="no-such-compiler-xyz")


def test_a_changed_local_header_rebuilds_the_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    (tmp_path / "value.h").write_text("inline int value() { return 1; }\n")
    source = tmp_path / "uses_header.cpp"
    source.write_text('#include "value.h"\nextern "C" int f() { return value(); }\n')
    first = cpp_build.build(source)
    assert ctypes.CDLL(str(first)).f() == 1
    (tmp_path / "value.h").write_text("inline int value() { return 2; }\n")
    second = cpp_build.build(source)
    assert second != first and ctypes.CDLL(str(second)).f() == 2


def test_build_all_builds_what_is_switched_on_and_leaves_failures_to_load(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setenv("TOOLKIT_TEST_OFF", "0")
    off = tmp_path / "off.cpp"
    off.write_text("int f() { return 0; }\n")
    cpp_build.build_all({decode_cpu.SOURCE: decode_cpu.SWITCH, broken: "TOOLKIT_TEST_ON", off: "TOOLKIT_TEST_OFF"})
    built = sorted(p.name.split("-")[0] for p in (tmp_path / "kernels").iterdir() if p.suffix == ".so")
    assert built == ["paged_decode_cpu"]  # the broken one raised nothing here; the switched-off one was skipped
    with pytest.warns(RuntimeWarning, match="broken.cpp failed"):
        assert cpp_build.load(broken, "TOOLKIT_TEST_ON", "test kernel", "nothing", {}) is None


def test_loading_the_kernel_keeps_subnormal_floats():
    """Built with -ffast-math, but not linked with it: loading must not set flush-to-zero for the
    whole process (it made an unrelated hypothesis test fail)."""
    assert decode_cpu.kernel_available()
    tiny = torch.tensor([1e-39])  # subnormal in float32
    assert (tiny * 1.0).item() != 0.0


@pytest.mark.parametrize("threads", [1, 2])
def test_per_row_and_per_kv_head_tasks_agree_with_dense(threads):
    """Few rows for the thread count split each row by kv head; enough rows make one task per row.
    With 1 thread the 7-row batch takes per-row tasks; every other case here splits."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernel's OpenMP runtime is torch's
    try:
        for specs in (DECODES, DECODES[-2:]):
            batch = make_batch(specs, block_size=16, num_heads=12, num_kv_heads=4, head_dim=64, seed=threads)
            torch.testing.assert_close(_decode(batch).double(), dense_reference(batch), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)
