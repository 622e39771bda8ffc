"""`few_row_linear`: F.linear's product in the other order for a few float32 rows on CPU, F.linear itself elsewhere;
`Int8Linear`: the draft logits' approximation, used where it is timed faster."""

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
    few_row_linear,
    int8_if_faster,
)


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


def test_int8_is_used_only_where_it_is_timed_faster(monkeypatch):
    """Chosen by timing both paths here; float32 CPU weights only."""
    w = torch.randn(64, 32)
    slow_int8 = Int8Linear.forward

    def sleepy(self, x):  # noqa: ANN001, ANN202
        time.sleep(0.003)
        return slow_int8(self, x)

    monkeypatch.setattr(Int8Linear, "forward", sleepy)
    assert int8_if_faster(w) is None
    monkeypatch.undo()
    exact = cpu_linear.few_row_linear
    monkeypatch.setattr(cpu_linear, "few_row_linear", lambda x, weight: (time.sleep(0.003), exact(x, weight))[1])
    assert isinstance(int8_if_faster(w), Int8Linear)
    assert int8_if_faster(w.bfloat16()) is None
