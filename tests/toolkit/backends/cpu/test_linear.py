"""The CPU linear (toolkit/backends/cpu/linear.py, csrc/linear.cpp) against float64 matmuls, eager and
compiled, through both implementations behind the op, and the choice between them."""

import json

import pytest
import torch

from toolkit.backends.cpu import kernels, linear
from toolkit.backends.cpu.huge_pages import HUGE_PAGE
from toolkit.backends.cpu.linear import NEVER, CPULinear, LinearPlan, pack_linears, plan_for

PANELS = LinearPlan(panels=True, onednn=False, small_m=NEVER, source="test")
BOTH = LinearPlan(panels=True, onednn=True, small_m=4, source="test")  # panels up to 4 rows, oneDNN above


def _needs_native_onednn(dtype) -> None:
    """oneDNN packs bf16 only with native units (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); without them
    plan_for never plans it (test_plans_by_rule_and_by_config checks that refusal)."""
    if not linear.onednn_native(dtype):
        pytest.skip(f"oneDNN has no native {dtype} on this CPU: the engine never plans oneDNN linears here")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.load() == {}  # a machine that runs the suite has a C++ compiler: a failed build fails


def _reference(x, lin):
    out = x.double() @ lin.weight.double().T
    return out if lin.bias is None else out + lin.bias.double()


def _linear(n, k, bias, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin.to(dtype)


# N not a multiple of 16 (a zero-padded last panel), K of 1 and odd, and every row-tile remainder
# (M mod 6) including the interleaved partial sums of 1-3 rows, plus more rows than one pass (192).
@pytest.mark.parametrize("n,k", [(1, 1), (16, 5), (33, 768), (250, 129)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_panels_match_float64(n, k, bias):
    lin = _linear(n, k, bias, seed=n * 1000 + k)
    packed = CPULinear(lin, PANELS)
    g = torch.Generator().manual_seed(1)
    for m in (1, 2, 3, 4, 5, 6, 7, 13, 193, 400):
        x = torch.randn(m, k, generator=g)
        out = packed(x)
        assert out.dtype == torch.float32 and out.shape == (m, n)
        torch.testing.assert_close(out.double(), _reference(x, lin), atol=1e-4 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("k", [129, 130])
@pytest.mark.parametrize("threads", [1, 2])
def test_few_rows_against_groups_of_panels_match_float64_for_every_weight_layout(k, threads):
    """Fewer rows than a tile (a decode step's, a verify step's) stream several panels at once per
    thread (8 for 1-2 rows, 4 for 3-6, 2 for 7), then the rest one by one: 30 panels, the last of 5
    columns, give groups and leftovers under one thread and two, for float32 panels,
    bf16 panels under float32 x (the lm_head's float32 logits: paired k on AVX-512 BF16 hosts), fp16 panels,
    and int8 panels (weight-only int8) with their scales; odd K leaves a k past the pairs."""
    from toolkit.backends.cpu.linear import CPUInt8Linear
    from toolkit.models.logits import Float32Logits
    from toolkit.quantization import Int8Linear

    n = 16 * 29 + 5
    g = torch.Generator().manual_seed(k)
    head = Float32Logits(k, n, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(n, k, generator=g))
    plain = _linear(n, k, True, seed=k)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cases = [(CPULinear(plain, PANELS), plain)]
        for half in HALVES:
            lowered = Float32Logits(k, n, bias=False).to(half)
            with torch.no_grad():
                lowered.weight.copy_(head.weight)
            cases.append((CPULinear(lowered, PANELS), lowered))
        quantized = Int8Linear(plain)
        dequantized = torch.nn.Linear(k, n)
        with torch.no_grad():
            dequantized.weight.copy_(quantized.qweight.double() * quantized.scales.double()[:, None])
            dequantized.bias.copy_(quantized.bias)
        cases.append((CPUInt8Linear(quantized, NEVER), dequantized))
        for m in (1, 2, 3, 5, 7):
            x = torch.randn(m, k, generator=g)
            for packed, reference in cases:
                out = packed(x)
                assert out.dtype == torch.float32 and out.shape == (m, n)
                torch.testing.assert_close(out.double(), _reference(x, reference), atol=1e-4 * k**0.5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_above_small_m_go_to_onednn_and_agree(dtype):
    _needs_native_onednn(dtype)
    lin = _linear(70, 300, True, seed=3, dtype=dtype)
    both, panels_only = CPULinear(lin, BOTH), CPULinear(lin, PANELS)
    assert both.panels is not None and both.onednn_weight is not None and panels_only.onednn_weight is None
    g = torch.Generator().manual_seed(4)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.25, rtol=2**-7)
    for m in (1, 4, 5, 64, 77):  # oneDNN gets 77 rows padded to 80 (onednn_rows), and returns 77
        x = torch.randn(m, 300, generator=g).to(dtype)
        out = both(x)
        assert out.shape == (m, 70) and out.is_contiguous()
        torch.testing.assert_close(out.double(), _reference(x, lin), **tol)
        if m <= 4:  # the same panel kernel on both sides: the same bits
            assert torch.equal(out, panels_only(x))
    rows = torch.randn(45, 600, generator=g).to(dtype)[:, :300]  # row stride 600, padded to 46 rows
    torch.testing.assert_close(both(rows).double(), _reference(rows, lin), **tol)


def test_panels_of_2_mib_and_more_start_on_a_huge_page_and_compute_alike():
    # 4100 x 300 float32: 4.7 MiB of panels, the last one zero-padded. (Whether the OS backs them with
    # huge pages depends on its THP setting, so only the layout is checked, and the result.)
    lin = _linear(4100, 300, True, seed=7)
    packed = CPULinear(lin, PANELS)
    assert packed.panels.nbytes >= 2 * HUGE_PAGE and packed.panels.is_contiguous()
    assert packed.panels.data_ptr() % HUGE_PAGE == 0
    x = torch.randn(3, 300)
    torch.testing.assert_close(packed(x).double(), _reference(x, lin), atol=1e-4 * 300**0.5, rtol=1e-5)
    small = CPULinear(torch.nn.Linear(64, 64), PANELS)  # below a page: a plain allocation
    assert small.panels.untyped_storage().nbytes() == small.panels.nbytes


HALVES = [torch.bfloat16, torch.float16]


# On AMX CPUs bf16 runs through the tiles in blocks of 32 k, 32 rows and two panels: K = 300 leaves
# an even tail of k, K = 97 an odd one (its last k unpaired); N = 70 an odd panel count; m = 17 and 40
# a part-filled second half of rows; the x of m = 7 is read with a row stride past K.
# (469, 129): 30 panels, the last of 5 columns, in groups of up to four per thread (AMX's few-row path).
# On AVX-512 BF16 without AMX (Zen 4) bf16 runs the dot products over pairs of k (dp_linear): the same
# shapes give it an odd K's unpaired k, an odd panel count (a single panel after the pairs), m = 1, 2
# and 7 its few-row groups of 8, 8 and 2 panels, m = 17 and 40 8-row tiles with and without a tail.
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("n,k", [(70, 300), (33, 97), (469, 129)])
def test_half_weights_and_activations(dtype, n, k):
    lin = _linear(n, k, True, seed=1, dtype=dtype)
    packed = CPULinear(lin, PANELS)
    assert packed.panels.dtype == dtype and packed.panels.shape == (-(-n // 16), k, 16)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    g = torch.Generator().manual_seed(2)
    for m in (1, 2, 7, 17, 40, 64):
        x = torch.randn(m, k + 3 * (m == 7), generator=g).to(dtype)[:, :k]
        out = packed(x)
        assert out.dtype == dtype
        # float32 accumulation of exact products, one rounding at the end: what torch computes in
        # float32 and rounds, up to the float32 summation order (1 ulp, or the float32 sum's own
        # error where a row cancels to near zero).
        expected = _reference(x, lin).float().to(dtype)
        torch.testing.assert_close(out.double(), expected.double(), atol=1e-4, rtol=ulp)


def test_float32_logits_over_bf16_weights_are_float32_where_they_compete():
    """A Float32Logits module (the lm_head): float32 x in, float32 logits out over bf16 weights. Up to
    small_m rows the panel kernel computes every entry in float32; above, a bf16 matmul of x rounded to
    bf16 (AMX's tiles up to 32 rows where the CPU has them, AVX-512 BF16's dot products at any row count
    where it has only those, oneDNN otherwise, or the float32 path where the layer has no oneDNN weight
    and the CPU neither) with each row's entries near
    its maximum (within 1/32 of it, + 0.05) recomputed in float32, so a near-tie that
    bf16 rounding would turn into a tie (two logits ~24 apart from zero, ~0.01 from each other: a bf16
    step there is 0.125) resolves as float32 does at every row count, and the rest are within bf16's
    rounding."""
    from toolkit.models.logits import Float32Logits

    n, k, a, b = 1000, 300, 700, 701
    g = torch.Generator().manual_seed(9)
    x0 = torch.randn(k, generator=g)
    head = Float32Logits(k, n, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        row = (24.0 * x0 / x0.dot(x0)).bfloat16()
        j = int(x0.abs().argmax())
        bumped = row.clone()
        bumped[j] = (row[j:j + 1].view(torch.int16) + 2).view(torch.bfloat16)[0]  # larger, of x0[j]'s sign
        head.weight[a], head.weight[b] = row.float(), bumped.float()
    head = head.to(torch.bfloat16)
    panels_only = CPULinear(head, LinearPlan(True, False, BOTH.small_m, "test"))
    assert panels_only.onednn_weight is None
    _check_float32_logits(panels_only, head, x0, a, b, g)
    _needs_native_onednn(torch.bfloat16)
    packed = CPULinear(head, BOTH)
    assert packed.panels is not None and packed.onednn_weight is not None
    _check_float32_logits(packed, head, x0, a, b, g)


def _check_float32_logits(packed, head, x0, a, b, g):
    k = x0.numel()
    # Panels up to 4 rows; above, the bf16 units (AMX's tiles up to 32 rows, the dot products), else oneDNN.
    for m in (1, 4, 5, 32, 33, 64):
        x = x0.repeat(m, 1) + 1e-3 * torch.randn(m, k, generator=g)
        out, ref = packed(x), _reference(x, head)
        assert out.dtype == torch.float32
        assert 0 < (ref[:, b] - ref[:, a]).min() < 0.05, "the constructed near-tie did not come out"
        assert torch.equal(out.argmax(-1), ref.argmax(-1)) and (out.argmax(-1) == b).all(), m
        near = ref >= ref.max(-1, keepdim=True).values - 0.5  # inside the band (0.8 at 24)
        assert near.sum() >= 2 * m
        torch.testing.assert_close(out[near].double(), ref[near], atol=1e-4 * k**0.5, rtol=1e-5)
        if m <= 4:
            torch.testing.assert_close(out.double(), ref, atol=1e-4 * k**0.5, rtol=1e-5)
        else:  # x rounded to bf16 (and oneDNN's output rounded once)
            torch.testing.assert_close(out.double(), ref, atol=0.05, rtol=2**-7)


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
    lin = torch.nn.Linear(2, 64, bias=False).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
    out = CPULinear(lin, PANELS)(torch.ones(1, 2, dtype=dtype))
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
    lin = torch.nn.Linear(1, 4, bias=False).to(dtype)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    packed = CPULinear(lin, PANELS)
    for special in (float("nan"), float("inf"), -float("inf")):
        out = packed(torch.tensor([[special]], dtype=dtype))
        torch.testing.assert_close(out.float(), torch.full((1, 4), special), equal_nan=True)


def test_row_strided_input_and_compiled_graph():
    lin = _linear(48, 64, False, seed=5)
    packed = CPULinear(lin, PANELS)
    rows = torch.randn(10, 128)[:, :64]  # row stride 128, as a split of a merged projection: read in place
    torch.testing.assert_close(packed(rows).double(), _reference(rows, lin), atol=1e-4, rtol=1e-5)
    compiled = torch.compile(lambda x: packed(x) * 2.0, fullgraph=True, dynamic=True)
    for m in (3, 9):
        x = torch.randn(m, 64)
        torch.testing.assert_close(compiled(x), packed(x) * 2.0)


def test_bad_inputs_raise():
    packed = CPULinear(torch.nn.Linear(32, 20), PANELS)
    with pytest.raises(RuntimeError, match="do not fit panels"):
        packed(torch.randn(4, 31))
    with pytest.raises(RuntimeError, match="unit stride"):
        packed(torch.randn(32, 4).t())
    with pytest.raises(RuntimeError, match="weights' dtype"):
        packed(torch.randn(4, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.toolkit.linear_cpu(torch.randn(4, 32), packed.panels, None, None, 33, NEVER)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        linear.pack(torch.randn(4, 4, dtype=torch.float64))


def test_pack_linears_swaps_every_linear_and_copies_a_tied_head():
    embedding = torch.nn.Embedding(40, 16)
    head = torch.nn.Linear(16, 40, bias=False)
    head.weight = embedding.weight  # tied
    model = torch.nn.ModuleDict({"embed": embedding, "block": torch.nn.Sequential(torch.nn.Linear(16, 16)),
                                 "head": head})
    x = torch.randn(3, 16)
    want = head(x)
    assert pack_linears(model, PANELS) == 2
    assert isinstance(model["head"], CPULinear) and isinstance(model["block"][0], CPULinear)
    assert isinstance(model["embed"], torch.nn.Embedding)  # the embedding keeps the original weight
    torch.testing.assert_close(model["head"](x), want, atol=1e-5, rtol=1e-5)


def test_pack_linears_lays_a_models_panels_side_by_side_on_huge_pages():
    """Weights under 2 MiB each (most of a small model's) share whole huge pages: one allocation on a
    2 MiB boundary holds every panel, each on its own cache line, none overlapping, and each linear
    still computes its own product."""
    torch.manual_seed(3)
    # 0.24, 0.09, 0.53 and 2.56 MiB of float32 panels
    model = torch.nn.Sequential(*[torch.nn.Linear(k, n) for n, k in ((300, 200), (70, 300), (2000, 70), (330, 2000))])
    x = torch.randn(5, 200)
    want = model(x)
    assert pack_linears(model, PANELS) == 4
    spans = sorted((m.panels.data_ptr(), m.panels.data_ptr() + m.panels.nbytes) for m in model)
    base = spans[0][0]
    assert base % HUGE_PAGE == 0
    assert len({m.panels.untyped_storage().data_ptr() for m in model}) == 1
    assert all(start % 64 == 0 for start, _ in spans)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] - base <= sum(m.panels.nbytes + 64 for m in model)
    torch.testing.assert_close(model(x), want, atol=1e-4, rtol=1e-4)


def test_plans_by_rule_and_by_config(monkeypatch):
    shapes = [(64, 32)]
    assert plan_for("torch", torch.float32, shapes) is None  # plain nn.Linear
    assert plan_for("panel", torch.bfloat16, shapes) == LinearPlan(True, False, NEVER, "config")
    monkeypatch.setattr(linear, "onednn_native", lambda dtype: False)
    rule = plan_for("auto", torch.bfloat16, shapes)  # emulated oneDNN is never measured against
    assert (rule.panels, rule.onednn, rule.small_m) == (True, False, NEVER) and rule.source.startswith("rule")
    with pytest.raises(ValueError, match="no native"):
        plan_for("onednn", torch.bfloat16, shapes)


def test_float32_x_over_half_weights_gets_its_own_measured_crossover(tmp_path, monkeypatch):
    """On AMX the panel kernel runs half x through the tiles and float32 x (the float32 logits) through
    FMAs, so their crossovers to oneDNN differ: each is measured, and a Float32Logits layer takes its own."""
    from toolkit.models.logits import Float32Logits

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(linear, "onednn_native", lambda dtype: True)
    monkeypatch.setattr(linear, "_measure_small_m", lambda dtype, shapes, x_dtype=None: 8 if x_dtype == torch.float32 else 64)
    plan = plan_for("auto", torch.bfloat16, [(64, 32)])
    assert (plan.small_m, plan.float32_small_m) == (64, 8) and "float32 x: up to 8" in plan.describe()
    assert plan_for("auto", torch.bfloat16, [(64, 32)]) == LinearPlan(True, True, 64, "cached", float32_small_m=8)
    head = Float32Logits(32, 48, bias=False).to(torch.bfloat16)
    assert CPULinear(head, plan).small_m == 8
    assert CPULinear(torch.nn.Linear(32, 48).to(torch.bfloat16), plan).small_m == 64
    # Where both crossovers agree, the plan says so once.
    monkeypatch.setattr(linear, "_measure_small_m", lambda dtype, shapes, x_dtype=None: 16)
    assert plan_for("auto", torch.bfloat16, [(96, 32)]).float32_small_m is None
    # Where the panels are never beaten (no oneDNN weight is kept), bf16's float32 x is still measured: AVX-512
    # BF16's dot products take it without one. fp16 has no such path.
    monkeypatch.setattr(linear, "_measure_small_m", lambda dtype, shapes, x_dtype=None: 2 if x_dtype else NEVER)
    never = plan_for("auto", torch.bfloat16, [(128, 32)])
    assert never == LinearPlan(True, False, NEVER, "measured", float32_small_m=2)
    assert never.describe() == "the panel kernel for every row count (float32 x: up to 2)"
    assert CPULinear(head, never).small_m == 2
    assert plan_for("auto", torch.float16, [(128, 32)]) == LinearPlan(True, False, NEVER, "measured")


def test_the_measured_choice_is_cached_per_machine_and_shapes(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(linear, "onednn_native", lambda dtype: True)
    measured = []
    monkeypatch.setattr(linear, "_measure_small_m", lambda dtype, shapes: measured.append(shapes) or 3)
    first = plan_for("auto", torch.float32, [(64, 32)])
    assert first == LinearPlan(True, True, 3, "measured")
    again = plan_for("auto", torch.float32, [(64, 32)])
    assert again == LinearPlan(True, True, 3, "cached") and len(measured) == 1
    plan_for("auto", torch.float32, [(128, 32)])  # other shapes: measured again
    assert len(measured) == 2
    (tmp_path / "kernels" / "linear-choices.json").write_text("{ damaged")
    assert plan_for("auto", torch.float32, [(64, 32)]).source == "measured"  # a damaged file is measured anew
    assert len(json.loads((tmp_path / "kernels" / "linear-choices.json").read_text())) == 1


def test_measuring_picks_the_faster_implementation_per_row_count(monkeypatch):
    """_measure_small_m on timings it is handed: the panel kernel up to the last row count before
    oneDNN's first clear win (confirmed at the next row count); none when oneDNN never wins; 0 when it
    wins from one row."""
    def with_times(panel, onednn):
        def fake_best_of_each(run, reps=5):
            m = linear.CANDIDATE_M[calls[0]]
            calls[0] += 1
            return panel(m), onednn(m)
        calls = [0]
        monkeypatch.setattr(linear, "best_of_each", fake_best_of_each)
        return linear._measure_small_m(torch.float32, [(32, 16)])

    assert with_times(lambda m: 1.0 + m, lambda m: 2.0 + 0.2 * m) == 1  # oneDNN wins from m = 2 (by > 5%)
    assert with_times(lambda m: 1.0, lambda m: 2.0) == NEVER
    assert with_times(lambda m: 2.0, lambda m: 1.0) == 0
    assert with_times(lambda m: 1.0, lambda m: 0.97) == NEVER  # within the margin: one layout is kept
    # One reading handed to oneDNN by noise (at m = 2) is not a crossover; the one it keeps is (m = 16 on).
    assert with_times(lambda m: 1.0, lambda m: 0.5 if m == 2 or m >= 16 else 2.0) == 12
    assert with_times(lambda m: 1.0, lambda m: 0.5 if m == linear.CANDIDATE_M[-1] else 2.0) == linear.CANDIDATE_M[-2]
