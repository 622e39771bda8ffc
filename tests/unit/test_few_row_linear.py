"""`few_row_linear`: F.linear's product in the other order for a few float32 rows on CPU, F.linear itself elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.cpu_linear import FEW_ROWS, PackedLinear, apply_few_rows, can_pack, few_row_linear


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
