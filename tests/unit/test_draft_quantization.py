"""A draft head on 8-bit GGUF blocks: ggml's Q8_0 quantizer, which linears are swapped, and when the
`draft_model_quantization` knob's auto turns it on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.models.cpu_linear import draft_quantization, quantize_linears
from specserve_kernels import gguf_gemm


@pytest.mark.skipif(not gguf_gemm.supported(), reason="the GGUF kernel needs x86-64 with AVX2, FMA and F16C")
def test_q8_0_blocks_are_ggml_s_and_quantize_linears_swaps_only_what_it_can():
    w = torch.randn(20, 64) * 0.05
    w[0, :32] = 0  # an all-zero block
    w[1, :32] = torch.linspace(-1, 1, 32)
    w[1, 5] = 2.5 * 2 / 127  # with d = 2 / 127: exactly half way, rounds away from zero
    w[1, 0] = -2
    raw = gguf_gemm.quantize_q8_0(w)
    assert raw.shape == (20, 2 * 34)
    codes, d, _ = gguf_gemm.codes_and_scales(raw, gguf_gemm.Q8_0)
    assert codes.abs().max() == 127 and d[0, 0] == 0 and codes[0, 0].eq(0).all()
    assert codes[1, 0, 0] == -127 and codes[1, 0, 5] == 3
    exact_d = w.reshape(20, 2, 32).abs().amax(-1) / 127
    err = (gguf_gemm.dequantize(raw, gguf_gemm.Q8_0) - w).reshape(20, 2, 32).abs()
    assert (err <= exact_d[..., None] * (0.5 + 127 * 2**-11)).all()  # half a step, and d's float16 rounding
    with pytest.raises(ValueError, match="whole blocks"):
        gguf_gemm.quantize_q8_0(torch.zeros(4, 40))

    assert gguf_gemm.load()
    module = nn.Sequential(nn.Linear(64, 48, bias=False), nn.Linear(48, 64, bias=True), nn.Linear(40, 8, bias=False))
    assert quantize_linears(module) == 1
    assert isinstance(module[0], gguf_gemm.GGUFLinear) and type(module[1]) is nn.Linear and type(module[2]) is nn.Linear
    plain = nn.Linear(64, 48, bias=False)
    x = torch.randn(3, 64)
    with torch.no_grad():
        quantized = gguf_gemm.GGUFLinear(gguf_gemm.quantize_q8_0(plain.weight), gguf_gemm.Q8_0)
        assert torch.linalg.norm(quantized(x) - plain(x)) < 0.01 * torch.linalg.norm(plain(x))


def test_draft_quantization_resolves_auto_and_refuses_what_cannot_run():
    assert draft_quantization("unquant", "cpu", torch.float32) == "unquant"
    assert draft_quantization("auto", "cpu", torch.bfloat16) == "unquant"
    assert draft_quantization("auto", "cuda", torch.float32) == "unquant"
    assert draft_quantization("auto", "cpu", torch.float32) == ("q8_0" if gguf_gemm.supported() else "unquant")
    with pytest.raises(ValueError, match="draft_model_quantization"):
        draft_quantization("q8_0", "cpu", torch.bfloat16)
