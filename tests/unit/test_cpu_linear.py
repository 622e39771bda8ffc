"""Prepacked bf16 linears (cpu_linear): bit-identical to F.linear at a few rows, packed where asked, nowhere else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve.bench import weight_bytes_per_token
from specserve.models.cpu_linear import PackedLinear, can_pack, pack_for_inference, pack_linears
from specserve.models.eagle_head import SharedLmHead
from specserve.models.kv_cache import KVCache
from specserve.models.weights import load_llama

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.bfloat16), reason="this CPU's oneDNN has no bf16 linear"
)


@pytest.mark.parametrize("shape", [(1, 96), (2, 3, 96), (1, 16, 96), (3, 9, 96)])  # 27 rows: run as 28
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical_to_f_linear(shape, bias):
    torch.manual_seed(0)
    w = torch.randn(200, 96, dtype=torch.bfloat16)
    b = torch.randn(200, dtype=torch.bfloat16) if bias else None
    x = torch.randn(*shape, dtype=torch.bfloat16)
    out = PackedLinear(w, b)(x)
    assert out.shape == (*shape[:-1], 200)
    assert torch.equal(out, F.linear(x, w, b))


def test_packed_linear_takes_non_contiguous_inputs():
    w = torch.randn(64, 32, dtype=torch.bfloat16)
    x = torch.randn(32, 5, dtype=torch.bfloat16).t()  # (5, 32), strided
    assert torch.equal(PackedLinear(w)(x), F.linear(x, w))


def test_pack_linears_replaces_every_linear_and_keeps_only_asked_weights():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    model.lm_head = nn.Linear(4, 10, bias=False)
    model.to(torch.bfloat16)
    assert pack_linears(model, keep_weights=("lm_head",)) == 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.lm_head.weight is not None and model[0].weight is None


def test_pack_for_inference_leaves_fp32_alone():
    model = nn.Sequential(nn.Linear(8, 8))
    assert pack_for_inference(model) == 0 and isinstance(model[0], nn.Linear)


@torch.no_grad()
def test_packed_target_forward_equals_plain(tiny_llama_factory):
    """The whole target: same logits and hidden states, bit for bit, prefill then decode."""
    path = tiny_llama_factory(vocab_size=300, num_layers=2)
    outs = []
    for pack in (False, True):
        model = load_llama(path, torch.bfloat16)
        bytes_before = weight_bytes_per_token(model)
        if pack:
            assert pack_for_inference(model, keep_weights=("lm_head",)) == 2 * 4 + 1
            assert weight_bytes_per_token(model) == bytes_before
        model.init_rope(64)
        cache = KVCache(model.cfg, 1, 64, torch.bfloat16, "cpu")
        ids = torch.arange(10, 22)[None]
        results = []
        for tokens, start in ((ids[:, :11], 0), (ids[:, 11:], 11)):
            positions = torch.arange(start, start + tokens.shape[1])[None]
            a = model.attention_inputs(positions, torch.tensor([0]), torch.tensor([start]), None, cache, [start], [0])
            out = model(tokens, a, cache)
            results += [out.logits, out.hidden]
        outs.append(results)
    for plain, packed in zip(*outs):
        assert torch.equal(plain, packed)


def test_shared_lm_head_pack_keeps_logits_and_hot_ids():
    torch.manual_seed(0)
    weight = torch.randn(50, 16, dtype=torch.bfloat16)
    head = SharedLmHead(weight)
    head.restrict(torch.tensor([3, 7, 11]))
    h = torch.randn(2, 16, dtype=torch.bfloat16)
    plain = head.logits(h)
    head.pack()
    assert head.packed is not None
    assert torch.equal(head.logits(h), plain)
    assert head.to_target_ids(torch.tensor([2])).item() == 11
