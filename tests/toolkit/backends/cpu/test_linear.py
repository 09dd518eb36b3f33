"""The CPU panel linear (toolkit/linear_cpu.py) against float64 matmuls, eager and compiled."""

import pytest
import torch

from toolkit import linear_cpu
from toolkit.linear_cpu import PanelLinear

# No skip when the kernel is unavailable: the project needs a C++ compiler (torch.compile on CPU does),
# so a kernel that fails to build must fail these tests, as the decode kernel's do.

def _reference(x, linear):
    out = x.double() @ linear.weight.double().T
    return out if linear.bias is None else out + linear.bias.double()


# N not a multiple of 16 (a zero-padded last panel), K of 1 and odd, and every row-tile remainder
# (M mod 6) including the interleaved partial sums of 1-3 rows, plus more rows than one pass (192).
@pytest.mark.parametrize("n,k", [(1, 1), (16, 5), (33, 768), (250, 129)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_matches_float64(n, k, bias):
    g = torch.Generator().manual_seed(n * 1000 + k)
    linear = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(n, generator=g))
    packed = PanelLinear(linear)
    for m in (1, 2, 3, 4, 5, 6, 7, 13, 193, 400):
        x = torch.randn(m, k, generator=g)
        out = packed(x)
        assert out.dtype == torch.float32 and out.shape == (m, n)
        torch.testing.assert_close(out.double(), _reference(x, linear), atol=1e-4 * k**0.5, rtol=1e-5)


def test_panels_of_2_mib_and_more_start_on_a_huge_page_and_compute_alike():
    # 4100 x 300 float32: 4.7 MiB of panels, the last one zero-padded. (Whether the OS backs them with
    # huge pages depends on its THP setting, so only the layout is checked, and the result.)
    g = torch.Generator().manual_seed(7)
    linear = torch.nn.Linear(300, 4100, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(4100, 300, generator=g))
    packed = PanelLinear(linear)
    assert packed.panels.nbytes >= 2 * linear_cpu.HUGE_PAGE and packed.panels.is_contiguous()
    assert packed.panels.data_ptr() % linear_cpu.HUGE_PAGE == 0
    x = torch.randn(3, 300, generator=g)
    torch.testing.assert_close(packed(x).double(), _reference(x, linear), atol=1e-4 * 300**0.5, rtol=1e-5)
    small = PanelLinear(torch.nn.Linear(64, 64))  # below a page: a plain allocation
    assert small.panels.untyped_storage().nbytes() == small.panels.nbytes


HALVES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALVES)
def test_half_weights_and_activations(dtype):
    g = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(300, 70, bias=True).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(70, 300, generator=g))
        linear.bias.copy_(torch.randn(70, generator=g))
    packed = PanelLinear(linear)
    assert packed.panels.dtype == dtype and packed.panels.shape == (5, 300, 16)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    for m in (1, 2, 7, 64):
        x = torch.randn(m, 300, generator=g).to(dtype)
        out = packed(x)
        assert out.dtype == dtype
        # float32 accumulation of exact products, one rounding at the end: what torch computes in
        # float32 and rounds, up to the float32 summation order (1 ulp, or the float32 sum's own
        # error where a row cancels to near zero).
        expected = _reference(x, linear).float().to(dtype)
        torch.testing.assert_close(out.double(), expected.double(), atol=1e-4, rtol=ulp)
        # A float32 x against half weights: products of the same values, float32 out.
        out32 = packed(x.float())
        assert out32.dtype == torch.float32
        torch.testing.assert_close(out32.double(), _reference(x, linear), atol=1e-3, rtol=1e-5)
    # x in the other half type: converted around the kernel, the output in x's dtype.
    other = HALVES[1 - HALVES.index(dtype)]
    x = torch.randn(3, 300, generator=g)
    out = packed(x.to(other))
    assert out.dtype == other
    torch.testing.assert_close(out.double(), _reference(x.to(other), linear), atol=0.5, rtol=2**-6)


# Exact float32 sums a + b, which the kernel rounds once to the half type: halfway cases go to even
# and past the largest finite value to inf, as torch rounds. Per dtype: (a, b) pairs.
ROUNDING = {
    torch.bfloat16: [(1, 2**-8), (1, 3 * 2**-8), (-1, -(2**-8)), (1, 2**-9), (3.3895313892515355e38, 2**119),
                     (1e-40, 0), (2**-126, 2**-133)],
    torch.float16: [(1, 2**-11), (1, 3 * 2**-11), (-1, -(2**-11)), (1, 2**-12), (65504, 16), (65504, 15),
                    (2**-24, 0), (2**-14, 2**-24)],
}


@pytest.mark.parametrize("dtype", HALVES)
def test_half_output_rounds_like_torch(dtype):
    g = torch.Generator().manual_seed(2)
    pairs = torch.tensor(ROUNDING[dtype], dtype=torch.float64)
    pairs = torch.cat([pairs, torch.randn(64 - len(pairs), 2, generator=g, dtype=torch.float64)])
    weight = pairs.to(dtype)  # [64, 2]: column n computes a_n * 1 + b_n * 1
    linear = torch.nn.Linear(2, 64, bias=False).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    out = PanelLinear(linear)(torch.ones(1, 2, dtype=dtype))
    assert out.dtype == dtype
    expected = (weight[:, 0].float() + weight[:, 1].float()).to(dtype)
    assert torch.equal(out[0], expected)
    if dtype == torch.bfloat16:
        assert out[0, :2].tolist() == [1.0, 1 + 2**-6] and out[0, 4].item() == float("inf")
    else:
        assert out[0, :2].tolist() == [1.0, 1 + 2**-9] and out[0, 4].item() == float("inf")
        assert out[0, 5].item() == 65504


@pytest.mark.parametrize("dtype", HALVES)
def test_half_nan_and_inf_pass_through(dtype):
    linear = torch.nn.Linear(1, 4, bias=False).to(dtype)
    with torch.no_grad():
        linear.weight.fill_(1.0)
    packed = PanelLinear(linear)
    for special in (float("nan"), float("inf"), -float("inf")):
        out = packed(torch.tensor([[special]], dtype=dtype))
        torch.testing.assert_close(out.float(), torch.full((1, 4), special), equal_nan=True)


def test_strided_input_and_compiled_graph():
    linear = torch.nn.Linear(64, 48, bias=False)
    packed = PanelLinear(linear)
    x = torch.randn(10, 128)[:, ::2]  # inner stride 2: copied to contiguous rows
    torch.testing.assert_close(packed(x).double(), _reference(x, linear), atol=1e-4, rtol=1e-5)
    rows = torch.randn(10, 128)[:, :64]  # row stride 128: read in place
    torch.testing.assert_close(packed(rows).double(), _reference(rows, linear), atol=1e-4, rtol=1e-5)
    compiled = torch.compile(lambda x: packed(x) * 2.0, fullgraph=True, dynamic=True)
    for m in (3, 9):
        x = torch.randn(m, 64)
        torch.testing.assert_close(compiled(x), packed(x) * 2.0)


def test_bad_shapes_raise():
    packed = PanelLinear(torch.nn.Linear(32, 20))
    with pytest.raises(ValueError, match="does not match panels"):
        packed(torch.randn(4, 31))
    with pytest.raises(ValueError, match="out_features"):
        torch.ops.toolkit.linear_cpu.default(torch.randn(4, 32), packed.panels, 33, None)
    with pytest.raises(ValueError, match="2-d float32, bfloat16 or float16"):
        linear_cpu.pack(torch.randn(4, 4, dtype=torch.float64))


def test_missing_compiler_warns_and_reports_unavailable(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    linear_cpu._library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="CPU linear kernel unavailable"):
            assert not linear_cpu.available(torch.float32)
    finally:
        monkeypatch.undo()
        linear_cpu._library.cache_clear()
    assert linear_cpu.available(torch.float32)
