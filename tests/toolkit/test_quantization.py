"""Weight-only int8 (toolkit/quantization.py, quantization="int8").

Oracles: the quantizer's error is within half a scale per weight (round to nearest); the CPU kernel
(`toolkit::linear_int8_cpu`, both its int8 panel path and its widened-weight oneDNN path) equals the
float64 matmul over the dequantized weights within the float32 accumulation and, for half x, the
half rounding bounds; and an engine with quantization="int8" gives transformers' greedy tokens and
close logits when transformers runs the same dequantized weights (an untied model: the embedding
keeps its float weights, as the engine's does).
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import hf_greedy, random_prompts, write_checkpoint
from toolkit import LLM, SamplingParams
from toolkit.quantization import Int8Linear, quantize_int8

EPS32 = 2.0**-24  # float32's unit roundoff
HALF_UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def test_quantized_weights_are_within_half_a_scale_and_use_the_whole_range():
    w = torch.randn(37, 53, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float()
    w[5] = 0  # an all-zero row
    w[6] *= 1e-30  # a tiny one
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32 and q.shape == w.shape
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    err = (w.double() - q.double() * scales.double()[:, None]).abs()
    assert (err <= scales.double()[:, None] * (0.5 + 1e-6)).all()
    assert (q[5] == 0).all() and (q[6].abs().amax() == 127)
    nonzero = [r for r in range(37) if r != 5]
    assert (q[nonzero].abs().amax(dim=1) == 127).all(), "each row's largest weight maps to +-127"


def _kernel():
    from toolkit.backends.cpu import kernels

    kernels.load()
    if not kernels.available("linear"):
        pytest.fail("the CPU linear kernel did not build (a C++ compiler is part of the set-up)")


def _reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias):
    w = q.double() * scales.double()[:, None]
    ref = x.double() @ w.T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    return ref, magnitude


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 13, 64, 65, 200])
def test_int8_kernel_equals_the_dequantized_matmul(dtype, m):
    from toolkit.backends.cpu.linear import INT8_SMALL_M, NEVER, CPUInt8Linear, onednn_native

    _kernel()
    g = torch.Generator().manual_seed(m)
    n, k = 45, 77  # neither a multiple of the 16-column panels; odd K
    linear = torch.nn.Linear(k, n, bias=True).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g))
        linear.bias.copy_(torch.randn(n, generator=g))
    quantized = Int8Linear(linear)
    paths = [NEVER] + ([INT8_SMALL_M] if onednn_native(dtype) else [])
    x = torch.randn(m, k, generator=g).to(dtype)
    ref, magnitude = _reference(x, quantized.qweight, quantized.scales, quantized.bias)
    for small_m in paths:
        y = CPUInt8Linear(quantized, small_m)(x)
        assert y.dtype == dtype and y.shape == (m, n)
        bound = (k + 2) * EPS32 * magnitude
        if dtype != torch.float32:
            unit = HALF_UNIT[dtype]
            bound = bound + unit * ref.abs() * 1.01  # the output rounded to the half dtype
        if dtype != torch.float32 and m > small_m:  # oneDNN's path: the weights rounded to x's dtype
            bound = bound + 2 * HALF_UNIT[dtype] * magnitude
        assert ((y.double() - ref).abs() <= bound + 1e-30).all(), (small_m, (y.double() - ref).abs().max())
    # The portable module (any device) computes the same matmul in x's dtype.
    assert torch.allclose(quantized(x).double(), ref, atol=float((4 * HALF_UNIT.get(dtype, 1e-5) * magnitude).max()))


def test_float32_logits_stay_float32_under_int8():
    from toolkit.backends.cpu.linear import NEVER, CPUInt8Linear
    from toolkit.models.logits import Float32Logits

    _kernel()
    head = Float32Logits(64, 40, bias=False).to(torch.bfloat16)
    quantized = Int8Linear(head)
    x = torch.randn(3, 64)  # the final norm's float32 output
    y = CPUInt8Linear(quantized, NEVER)(x)
    ref, magnitude = _reference(x, quantized.qweight, quantized.scales, None)
    assert y.dtype == torch.float32
    assert ((y.double() - ref).abs() <= 66 * EPS32 * magnitude + 1e-30).all()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A float32 llama checkpoint, and the same model with every linear replaced by its dequantized int8
    weights (what the engine computes with), for transformers."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("int8")
    ckpt = write_checkpoint(root / "llama", "llama3", seed=4)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert not model.config.tie_word_embeddings
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                q, scales = quantize_int8(module.weight)
                module.weight.copy_(q.float() * scales[:, None])
    dequantized = root / "dequantized"
    model.save_pretrained(dequantized, safe_serialization=True)
    return ckpt, dequantized


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_an_int8_engine_gives_transformers_tokens_on_the_dequantized_weights(pair, eager):
    ckpt, dequantized = pair
    prompts = random_prompts(4, seed=9)
    llm = LLM(str(ckpt), dtype="float32", enforce_eager=eager, quantization="int8", skip_tokenizer_init=True,
              max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)
    expected = hf_greedy(dequantized, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # The float checkpoint's own tokens differ somewhere, or the test could not tell int8 from float.
    assert expected != hf_greedy(ckpt, prompts, 8) or _logits_differ(ckpt, dequantized, prompts[0])
    from toolkit.backends.cpu.linear import CPUInt8Linear

    # Every linear runs the int8 kernel: 2 layers x (q/k/v merged, o, gate/up merged, down), and the lm_head.
    assert sum(isinstance(m, CPUInt8Linear) for m in llm.engine.runner.model.modules()) == 9


def _logits_differ(a, b, prompt) -> bool:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        la = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)(torch.tensor([prompt])).logits
        lb = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)(torch.tensor([prompt])).logits
    return not torch.equal(la, lb)


def test_int8_is_refused_with_tensor_parallelism_and_other_schemes_by_name(pair):
    ckpt, _ = pair
    with pytest.raises(ValueError, match="tensor_parallel_size does not combine with quantization='int8'"):
        LLM(str(ckpt), quantization="int8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization='gptq' is not supported"):
        LLM(str(ckpt), quantization="gptq")
