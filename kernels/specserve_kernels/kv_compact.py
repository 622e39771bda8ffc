"""Move the accepted tree nodes' K/V into place, in place, after verification.

The verify forward wrote node i's K/V at position cache_lens + i of the request's cache slot.
The accepted path [0, c1, c2, ...] becomes the next tokens of the sequence:

    position:   cache_lens + 0   + 1   + 2   + 3   + 4
    before:             r     a     b     c     d         accepted_nodes = [0, 2, 4]
    after:              r     b     d     c     d         positions past accept_length are stale

Accepted node indices increase strictly, so accepted_nodes[j] >= j: copying in ascending j never
reads a position an earlier copy wrote, and the copy can be done in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve_kernels._launch import check_same_device, check_shape, check_tensor, use_triton

# The kernel moves raw bits, so every float dtype travels as the integer of its size.
_BITS_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit(do_not_specialize=["stride_acc_b"])  # the tree size N
def _compact_kv_kernel(
    kv_ptr,
    slots_ptr,
    cache_lens_ptr,
    accepted_ptr,
    accept_length_ptr,
    D,
    stride_kv_l,
    stride_kv_kv,
    stride_kv_s,
    stride_kv_h,
    stride_kv_t,
    stride_kv_d,
    stride_slots_b,
    stride_lens_b,
    stride_acc_b,
    stride_acc_n,
    stride_len_b,
    BLOCK_D: tl.constexpr,
):
    """One program per (request, layer * 2 + k/v, head): copies accept_length rows of D values."""
    b = tl.program_id(0).to(tl.int64)
    layer_kv = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    slot = tl.load(slots_ptr + b * stride_slots_b)
    base = tl.load(cache_lens_ptr + b * stride_lens_b)
    length = tl.load(accept_length_ptr + b * stride_len_b)
    head = kv_ptr + (layer_kv // 2) * stride_kv_l + (layer_kv % 2) * stride_kv_kv
    head += slot * stride_kv_s + h * stride_kv_h
    d = tl.arange(0, BLOCK_D)
    in_d = d < D
    for j in range(length):  # ascending: each element is read and written by the same thread
        src = tl.load(accepted_ptr + b * stride_acc_b + j * stride_acc_n)
        row = tl.load(head + (base + src) * stride_kv_t + d * stride_kv_d, mask=in_d)
        tl.store(head + (base + j) * stride_kv_t + d * stride_kv_d, row, mask=in_d)


def compact_kv(
    kv: torch.Tensor,
    slots: torch.Tensor,
    cache_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    accept_length: torch.Tensor,
) -> None:
    """In place: kv[:, :, slots[b], :, cache_lens[b] + j] = kv[..., cache_lens[b] + accepted_nodes[b, j]]
    for j < accept_length[b].

    Parameters
    ----------
    kv : torch.Tensor
        The KV cache: layers, K/V, cache slots, heads, positions, head dim.
    slots : torch.Tensor
        Each request's cache slot.
    cache_lens : torch.Tensor
        Each request's cached length before the verify step (where the tree's root was written).
    accepted_nodes, accept_length : torch.Tensor
        From `verify_greedy` / `verify_sample`.

    Shape:
        kv: (L, 2, S, H, T, D) any float dtype
        slots, cache_lens, accept_length: (B,) int64
        accepted_nodes: (B, N) int64, -1 padded

    Values are not checked (that would need a host sync): slots must be distinct and in [0, S),
    and cache_lens[b] + accepted_nodes[b, j] must lie in [0, T).
    """
    check_tensor("kv", kv, None, 6)
    if kv.shape[1] != 2:
        raise ValueError(f"kv: expected shape (L, 2, S, H, T, D), got {tuple(kv.shape)}")
    check_tensor("slots", slots, torch.int64, 1)
    bsz = slots.shape[0]
    check_tensor("cache_lens", cache_lens, torch.int64, 1)
    check_shape("cache_lens", cache_lens, (bsz,))
    check_tensor("accepted_nodes", accepted_nodes, torch.int64, 2)
    if accepted_nodes.shape[0] != bsz:
        raise ValueError(f"accepted_nodes: expected shape ({bsz}, N), got {tuple(accepted_nodes.shape)}")
    check_tensor("accept_length", accept_length, torch.int64, 1)
    check_shape("accept_length", accept_length, (bsz,))
    check_same_device(
        kv=kv, slots=slots, cache_lens=cache_lens, accepted_nodes=accepted_nodes, accept_length=accept_length
    )
    if not use_triton(kv):
        compact_kv_reference(kv, slots, cache_lens, accepted_nodes, accept_length)
        return

    num_layers, _, _, num_heads, _, head_dim = kv.shape
    if bsz == 0 or kv.numel() == 0:
        return
    bits = kv.view(_BITS_OF_SIZE[kv.element_size()])  # same storage and strides
    _compact_kv_kernel[(bsz, num_layers * 2, num_heads)](
        bits,
        slots,
        cache_lens,
        accepted_nodes,
        accept_length,
        head_dim,
        *bits.stride(),
        *slots.stride(),
        *cache_lens.stride(),
        *accepted_nodes.stride(),
        *accept_length.stride(),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1,
    )


def compact_kv_reference(
    kv: torch.Tensor,
    slots: torch.Tensor,
    cache_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    accept_length: torch.Tensor,
) -> None:
    """Plain-PyTorch `compact_kv`: per request, gather the accepted rows, then scatter them."""
    # Host sync: the per-request lengths drive Python slicing.
    for slot, base, nodes, length in zip(
        slots.tolist(), cache_lens.tolist(), accepted_nodes.tolist(), accept_length.tolist(), strict=True
    ):
        if nodes[:length] == list(range(length)):
            continue  # a path down a chain is where it belongs already
        cache = kv[:, :, slot]  # (L, 2, H, T, D) view
        src = torch.tensor(nodes[:length], dtype=torch.int64, device=kv.device) + base
        dst = torch.arange(length, dtype=torch.int64, device=kv.device) + base
        cache[:, :, :, dst] = cache[:, :, :, src]  # the gather copies before the scatter writes
