"""`few_row_linear`: F.linear's product in the other order for a few float32 rows on CPU, F.linear itself elsewhere;
`Int8Linear`: the draft logits' approximation; `fastest_logits_layer`: the draft logits' layer timed fastest here."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve.models import cpu_linear
from specserve.models.cpu_linear import (
    FEW_ROWS,
    Int8Linear,
    PackedLinear,
    apply_few_rows,
    can_pack,
    fastest_logits_layer,
    few_row_linear,
)
from specserve_kernels import few_row_gemm


@pytest.mark.parametrize("shape", [(1, 96), (4, 96), (2, 4, 96), (FEW_ROWS + 1, 96)])
def test_few_row_linear_matches_f_linear(shape):
    torch.manual_seed(0)
    w, x = torch.randn(300, 96), torch.randn(*shape)
    with torch.inference_mode():
        out = few_row_linear(x, w)
    assert out.shape == (*shape[:-1], 300)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_few_row_linear_keeps_autograd_and_other_dtypes_on_f_linear():
    w = torch.randn(50, 16, requires_grad=True)
    x = torch.randn(3, 16)
    few_row_linear(x, w).sum().backward()  # grad enabled: F.linear, differentiable
    assert w.grad is not None and w.grad.shape == w.shape
    xb, wb = x.bfloat16(), w.detach().bfloat16()
    with torch.inference_mode():
        assert torch.equal(few_row_linear(xb, wb), F.linear(xb, wb))


def test_apply_few_rows_routes_plain_linears_and_leaves_others():
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    plain, biased = nn.Linear(32, 64, bias=False), nn.Linear(32, 64)
    with torch.inference_mode():
        torch.testing.assert_close(apply_few_rows(plain, x), plain(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(apply_few_rows(biased, x), biased(x))
        if can_pack(torch.device("cpu"), torch.bfloat16):
            packed = PackedLinear(plain.weight.bfloat16())
            assert torch.equal(apply_few_rows(packed, x.bfloat16()), packed(x.bfloat16()))


def test_int8_linear_approximates_the_product_and_keeps_the_ranking():
    torch.manual_seed(0)
    w, x = torch.randn(300, 96) * 0.1, torch.randn(2, 4, 96)
    with torch.inference_mode():
        out, ref = Int8Linear(w)(x), F.linear(x, w)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def _slow(forward):  # noqa: ANN001, ANN202
    def sleepy(self, x):  # noqa: ANN001, ANN202
        time.sleep(0.003)
        return forward(self, x)

    return sleepy


def test_the_logits_layer_is_the_one_timed_fastest_here(monkeypatch):
    """Timed on this CPU among the few-row kernel (where loaded), the plain weight and int8; the two
    made slow here lose. Float32 CPU weights only."""
    w, x = torch.randn(64, 32), torch.randn(3, 32)
    kernel = few_row_gemm.load()
    plain = cpu_linear.few_row_linear
    slow = {
        "plain": lambda: monkeypatch.setattr(cpu_linear, "few_row_linear",
                                             lambda x, weight: (time.sleep(0.003), plain(x, weight))[1]),
        "int8": lambda: monkeypatch.setattr(Int8Linear, "forward", _slow(Int8Linear.forward)),
        "kernel": lambda: monkeypatch.setattr(few_row_gemm.FewRowLinear, "forward",
                                              _slow(few_row_gemm.FewRowLinear.forward)),
    }
    for fast, expected in (("plain", type(None)), ("int8", Int8Linear), ("kernel", few_row_gemm.FewRowLinear)):
        if fast == "kernel" and not kernel:
            continue
        for name, make_slow in slow.items():
            if name != fast:
                make_slow()
        layer = fastest_logits_layer(w)
        monkeypatch.undo()
        assert isinstance(layer, expected), fast
        if fast == "kernel":  # exact: the weight's own float32 products
            torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert fastest_logits_layer(w.bfloat16()) is None
