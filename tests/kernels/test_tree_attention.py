"""`tree_attention` against its reference, and the reference against dense masked attention."""

import pytest
import torch

from specserve.models.attention import grouped_attention
from specserve.models.llama import prefix_mask
from specserve_kernels import tree_attention, tree_attention_reference

CASES = [  # batch, query heads, KV heads, new tokens, head dim, max_len, with a tree mask
    (1, 3, 1, 1, 16, 40, False),
    (2, 4, 2, 5, 32, 300, True),  # two splits of keys
    (3, 9, 3, 8, 64, 96, True),  # SmolLM2's heads
    (2, 2, 2, 3, 24, 70, False),  # head dim not a power of two, causal new tokens
    (2, 4, 2, 40, 32, 600, False),  # a catch-up: 80 rows in two row blocks, each with two splits of keys
    (2, 4, 2, 40, 32, 600, True),
]


def _case(gen, b, hq, hkv, t, d, max_len, with_mask, dtype):
    slots_total = b + 2
    k_cache = torch.randn(slots_total, hkv, max_len, d, generator=gen).to(dtype)
    v_cache = torch.randn(slots_total, hkv, max_len, d, generator=gen).to(dtype)
    q = torch.randn(b, t, hq, d, generator=gen).to(dtype).transpose(1, 2)  # (B, Hq, T, D), strided as the model's
    slots = torch.randperm(slots_total, generator=gen)[:b]
    cache_lens = torch.randint(0, max_len - t + 1, (b,), generator=gen)
    new_mask = None
    if with_mask:  # a random tree: each node sees itself and a random subset of earlier nodes
        new_mask = (torch.rand(b, t, t, generator=gen) < 0.5).tril() | torch.eye(t, dtype=torch.bool)
    return q, k_cache, v_cache, slots, cache_lens, new_mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "hq", "hkv", "t", "d", "max_len", "with_mask"), CASES)
def test_kernel_matches_reference(kernel_device, dtype, b, hq, hkv, t, d, max_len, with_mask):
    gen = torch.Generator().manual_seed(b * 100 + t)
    args = [x.to(kernel_device) if x is not None else None
            for x in _case(gen, b, hq, hkv, t, d, max_len, with_mask, dtype)]
    want = tree_attention_reference(*args)
    got = tree_attention(*args, key_len=max_len)
    assert got.shape == (b, t, hq, d) and got.dtype == dtype
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_a_beam_scratch_area_wider_than_the_queries(kernel_device):
    """A drafter's beam: T = 2 nodes see the prefix and some of N = 6 scratch entries after it."""
    gen = torch.Generator().manual_seed(8)
    q, k, v, slots, lens, _ = _case(gen, 2, 4, 2, 2, 32, 90, False, torch.float32)
    visible = torch.rand(2, 2, 6, generator=gen) < 0.5
    visible[:, 0, 4], visible[:, 1, 5] = True, True  # each node sees at least its own entry
    args = [x.to(kernel_device) for x in (q, k, v, slots, lens, visible)]
    want = tree_attention_reference(*args)
    torch.testing.assert_close(tree_attention(*args, key_len=90), want, rtol=1e-4, atol=1e-4)
    dense = grouped_attention(q, k[slots], v[slots], prefix_mask(lens, visible, 90))
    torch.testing.assert_close(want.cpu(), dense.transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("t", "with_mask"), [(4, True), (40, False)])
def test_keys_past_the_live_length_are_never_read(kernel_device, t, with_mask):
    """NaNs beyond each request's cache_lens + T (stale scratch, another request's tokens) do not
    reach the output: the kernel stops at the live length (T = 40: two causal row blocks)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, slots, lens, mask = _case(gen, 2, 4, 2, t, 32, 300, with_mask, torch.float32)
    for i in range(2):
        k[slots[i], :, lens[i] + t:] = float("nan")
        v[slots[i], :, lens[i] + t:] = float("nan")
    args = [x.to(kernel_device) if x is not None else None for x in (q, k, v, slots, lens, mask)]
    out = tree_attention(*args, key_len=300)
    assert not out.isnan().any()


@pytest.mark.parametrize("with_mask", [False, True])
def test_reference_is_masked_attention(with_mask):
    gen = torch.Generator().manual_seed(5)
    q, k, v, slots, lens, mask = _case(gen, 3, 4, 2, 6, 16, 50, with_mask, torch.float32)
    t = q.shape[2]
    new_mask = mask if mask is not None else torch.ones(t, t, dtype=torch.bool).tril().expand(3, t, t)
    dense = grouped_attention(q, k[slots], v[slots], prefix_mask(lens, new_mask, 50))  # (B, Hq, T, D)
    torch.testing.assert_close(tree_attention_reference(q, k, v, slots, lens, mask), dense.transpose(1, 2))
