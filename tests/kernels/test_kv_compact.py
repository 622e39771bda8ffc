import pytest
import torch

from specserve_kernels import compact_kv, compact_kv_reference


def loop_compact(kv: torch.Tensor, slots, cache_lens, accepted_nodes, accept_length) -> None:
    """The definition, one position at a time in ascending j."""
    for b in range(slots.shape[0]):
        s, base = int(slots[b]), int(cache_lens[b])
        for j in range(int(accept_length[b])):
            kv[:, :, s, :, base + j] = kv[:, :, s, :, base + int(accepted_nodes[b, j])].clone()


def random_case(gen: torch.Generator, shape: tuple[int, ...], batch: int, n: int, dtype: torch.dtype):
    """A KV cache and B requests in distinct slots, each with a random accepted path
    (0 first, strictly increasing, -1 padded) whose tree fits in the cache after cache_lens."""
    num_layers, _, num_slots, num_heads, max_len, head_dim = shape
    kv = torch.randn(shape, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[:batch]
    cache_lens = torch.randint(0, max_len - n + 1, (batch,), generator=gen)
    accepted_nodes = torch.full((batch, n), -1, dtype=torch.int64)
    accept_length = torch.randint(1, n + 1, (batch,), generator=gen)
    for b in range(batch):
        k = int(accept_length[b])
        rest = (torch.randperm(n - 1, generator=gen)[: k - 1] + 1).sort().values
        accepted_nodes[b, :k] = torch.cat([torch.zeros(1, dtype=torch.int64), rest])
    return kv, (slots, cache_lens, accepted_nodes, accept_length)


SHAPES = [  # (L, 2, S, H, T, D), batch, nodes per tree
    ((1, 2, 1, 1, 4, 1), 1, 1),
    ((2, 2, 4, 3, 24, 8), 3, 8),
    ((3, 2, 8, 2, 40, 24), 8, 16),  # D not a power of two
    ((1, 2, 5, 1, 70, 64), 5, 64),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("shape", "batch", "n"), SHAPES)
def test_reference_matches_loop(shape, batch: int, n: int, dtype: torch.dtype) -> None:
    kv, args = random_case(torch.Generator().manual_seed(batch * n), shape, batch, n, dtype)
    want = kv.clone()
    loop_compact(want, *args)
    compact_kv_reference(kv, *args)
    assert torch.equal(kv, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("shape", "batch", "n"), SHAPES)
def test_kernel_matches_reference(kernel_device, shape, batch: int, n: int, dtype: torch.dtype) -> None:
    kv, args = random_case(torch.Generator().manual_seed(batch * n + 1), shape, batch, n, dtype)
    want = kv.clone()
    compact_kv_reference(want, *args)
    got = kv.to(kernel_device)
    compact_kv(got, *(t.to(kernel_device) for t in args))
    assert torch.equal(got.cpu(), want)


def test_kernel_on_a_strided_view(kernel_device) -> None:
    # The cache as a view into a larger buffer (every stride differs from the contiguous one).
    gen = torch.Generator().manual_seed(0)
    _, args = random_case(gen, (2, 2, 4, 3, 15, 8), 3, 6, torch.float16)
    big = torch.randn(2, 2, 4, 3, 30, 16, generator=gen).half()
    kv = big[:, :, :, :, ::2, 4:12]  # (2, 2, 4, 3, 15, 8)
    want = kv.clone()
    compact_kv_reference(want, *args)
    on_device = big.to(kernel_device)
    compact_kv(on_device[:, :, :, :, ::2, 4:12], *(t.to(kernel_device) for t in args))
    assert torch.equal(on_device[:, :, :, :, ::2, 4:12].cpu(), want)
    untouched = torch.ones_like(big, dtype=torch.bool)
    untouched[:, :, :, :, ::2, 4:12] = False
    assert torch.equal(on_device.cpu()[untouched], big[untouched])


def test_bad_input() -> None:
    kv = torch.zeros(1, 2, 2, 1, 8, 4)
    ok = (torch.tensor([0]), torch.tensor([0]), torch.tensor([[0, 1]]), torch.tensor([2]))
    with pytest.raises(ValueError, match="kv: expected a floating-point tensor"):
        compact_kv(kv.long(), *ok)
    with pytest.raises(ValueError, match=r"kv: expected shape \(L, 2, S, H, T, D\)"):
        compact_kv(torch.zeros(1, 3, 2, 1, 8, 4), *ok)
    with pytest.raises(ValueError, match="cache_lens: expected shape"):
        compact_kv(kv, ok[0], torch.tensor([0, 0]), *ok[2:])
    with pytest.raises(ValueError, match="accept_length: expected dtype torch.int64"):
        compact_kv(kv, *ok[:3], ok[3].int())
