"""Prepacked linears (toolkit/packed_linear.py): oneDNN's against nn.Linear, eager and compiled, and
which kernel pack_linears picks."""

import pytest
import torch
from torch import nn

from toolkit import linear_cpu
from toolkit.linear_cpu import PanelLinear
from toolkit.packed_linear import PackedLinear, onednn_supported, pack_linears, packing_supported

pytestmark = pytest.mark.skipif(not onednn_supported(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear, batch_hint=16)
    for rows in (1, 7, 16, 33):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    compiled = torch.compile(lambda x: packed(x) * 2.0, fullgraph=True, dynamic=True)
    for rows in (5, 40):  # one graph, dynamic rows: the custom op's fake gives the output shape
        x = torch.randn(rows, 96)
        torch.testing.assert_close(compiled(x), linear(x) * 2.0, atol=1e-5, rtol=1e-5)


def test_pack_linears_swaps_every_linear_and_keeps_the_rest():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)), nn.LayerNorm(4))
    x = torch.randn(3, 8)
    want = model(x)
    assert pack_linears(model, batch_hint=4) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    kind = PanelLinear if linear_cpu.available(torch.float32) else PackedLinear
    assert isinstance(model[0], kind) and isinstance(model[2][0], kind)
    assert isinstance(model[3], nn.LayerNorm)
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)


def test_packing_is_cpu_and_fast_dtypes_only():
    assert not packing_supported(torch.device("meta"), torch.float32)
    assert not packing_supported(torch.device("cpu"), torch.float64)
    assert not onednn_supported(torch.device("cpu"), torch.float16)
    assert onednn_supported(torch.device("cpu"), torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    # bf16 and fp16 are fast wherever the panel kernel is built: it widens them in float32 registers.
    assert packing_supported(torch.device("cpu"), torch.bfloat16) == (
        linear_cpu.available(torch.bfloat16) or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert packing_supported(torch.device("cpu"), torch.float16) == linear_cpu.available(torch.float16)


def test_without_the_panel_kernel_onednn_packs(monkeypatch):
    monkeypatch.setattr(linear_cpu, "available", lambda dtype: False)
    model = nn.Sequential(nn.Linear(8, 16))
    x = torch.randn(3, 8)
    want = model(x)
    assert pack_linears(model, batch_hint=4) == 1
    assert isinstance(model[0], PackedLinear)
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
