"""Decode and tree-verify attention over the slot KV cache, reading only each request's live keys.

Request b's T new queries (its tree, one decode token, or a catch-up's whole prompt) attend to its
slot's prefix [0, cache_lens[b]) and to the N entries after it where new_mask[b, t, j] (N = T,
causal, when there is no mask; a drafter's beam keeps N >= T scratch entries). The kernel walks
keys up to cache_lens[b] + N only, read from the device: a CUDA graph captured with a static grid
still reads just the live part of a long cache.

Layout (flash-decoding: split over the key axis, and over query rows when they are many):

    rows = T * G query rows           row t * G + g: new token t, query head g of KV head h's group
    grid = (B * Hkv, row blocks, splits)
    program (b, h, block, split)      rows [block * BLOCK_M, +BLOCK_M), keys [split * L, +L)
    scores (BLOCK_M, BLOCK_N) fp32    online softmax -> partial (acc, max, sum) per split
    a second kernel merges each row block's splits and writes (B, T, Hq, D) in the input dtype

BLOCK_M is capped, so shared memory and registers do not grow with T; a causal row block stops at
its last token's own key. The split length L grows with the row blocks (`_splits`), so a long
catch-up runs few splits and a decode many. T, N, L and the split count are runtime values the JIT
does not specialise on: one compiled kernel per (dtype, G, D, mask or causal, tile) serves every
cache length and T.

Scores and the softmax are float32 in registers; q, K, V and the output stay in their dtype
(bfloat16 on a GPU): no float32 copy of the cache. Exposed as the custom op
`specserve::tree_attention`, so tracing and the capture check see one op with a shape-only fake.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from specserve_kernels._launch import check_same_device, check_tensor, interpreting, use_triton

SPLIT_KEYS = 256  # keys per split when the rows fit one block: a long cache is read by several programs


class Tiles(NamedTuple):
    """The split kernel's tile (at 4 warps): query rows, and keys per step."""

    block_m: int
    block_n: int


def _tiles(rows: int, head_dim: int, dtype: torch.dtype) -> Tiles:
    """The tile for `rows` = G * T query rows, bounded whatever T is.

    Per program at 4 warps, the float32 accumulator (BLOCK_M, D), the scores (BLOCK_M, BLOCK_N)
    and a K or V tile (BLOCK_N, D) keep to a budget of elements: 8192 for 16-bit inputs, 6144 for
    float32 (its K/V tiles are twice the registers). BLOCK_M takes at most half of it (and 64 rows),
    BLOCK_N what is left (16-64 keys). Within these, `compile_check` finds no register spill on
    sm_80 or sm_90 for SmolLM2 (D = 64) and Llama-3.1-8B (D = 128) shapes.
    """
    budget = 6144 if dtype == torch.float32 else 8192
    d = max(16, triton.next_power_of_2(head_dim))
    cap = min(64, max(16, _floor_pow2(budget // 2 // d)))
    block_m = min(cap, max(16, triton.next_power_of_2(rows)))
    block_n = next((n for n in (64, 32) if block_m * d + block_m * n + n * d <= budget), 16)
    return Tiles(block_m, block_n)


def _floor_pow2(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def _splits(key_len: int, row_blocks: int) -> tuple[int, int]:
    """(split length, number of splits) over `key_len` keys: SPLIT_KEYS per split for one row
    block, longer splits for more, so programs x splits stays near max(row blocks, key_len / SPLIT_KEYS)."""
    split_len = SPLIT_KEYS * row_blocks
    return split_len, triton.cdiv(key_len, split_len)


@triton.jit(do_not_specialize=["T", "N", "split_len", "stride_mb", "stride_mt"])
def _tree_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, mask_ptr, part_o_ptr, part_ml_ptr,
    T, N, HKV, split_len, sm_scale,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_ks, stride_kh, stride_kn, stride_kd,
    stride_vs, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mt, stride_mj,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_MASK: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    split = tl.program_id(2)
    b = pid // HKV
    h = pid % HKV
    slot = tl.load(slots_ptr + b)
    cache_len = tl.load(lens_ptr + b).to(tl.int32)  # loop bounds in one integer type
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    t = rows // G  # new token
    g = rows % G  # query head within the group
    row_ok = rows < G * T
    if HAS_MASK:
        kv_len = cache_len + N
    else:  # causal: the block's last token sees no key after its own
        kv_len = cache_len + tl.minimum(T, (block * BLOCK_M + BLOCK_M - 1) // G + 1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + t[:, None] * stride_qt
                + d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    k_base = k_ptr + slot * stride_ks + h * stride_kh
    v_base = v_ptr + slot * stride_vs + h * stride_vh
    # DOT_F32: float32 inputs, or the interpreter (whose bf16 dot is wrong): the products in fp32, exactly
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        k = tl.load(k_base + cols[:, None] * stride_kn + d[None, :] * stride_kd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * sm_scale  # (BLOCK_M, BLOCK_N) fp32
        j = cols - cache_len  # index among the new tokens (negative: the prefix)
        if HAS_MASK:
            new_ok = tl.load(mask_ptr + b * stride_mb + t[:, None] * stride_mt + j[None, :] * stride_mj,
                             mask=row_ok[:, None] & (j[None, :] >= 0) & (j[None, :] < N) & col_ok[None, :], other=0)
            visible = (j[None, :] < 0) | (new_ok != 0)
        else:
            visible = j[None, :] <= t[:, None]
        visible = visible & col_ok[None, :] & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vn + d[None, :] * stride_vd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    # partials: (B * Hkv, row blocks, splits, BLOCK_M) rows
    part = ((pid * tl.num_programs(1) + block) * tl.num_programs(2) + split) * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(part_o_ptr + part[:, None] * BLOCK_D + d[None, :], acc)
    tl.store(part_ml_ptr + part * 2, m_i)
    tl.store(part_ml_ptr + part * 2 + 1, l_i)


@triton.jit(do_not_specialize=["T", "num_splits"])
def _tree_attention_merge_kernel(
    part_o_ptr, part_ml_ptr, out_ptr, T, HKV, num_splits,
    stride_ob, stride_ot, stride_oh, stride_od,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    first = (pid * tl.num_programs(1) + block) * num_splits  # this row block's first split
    local = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(part_ml_ptr + ((first + s) * BLOCK_M + local) * 2))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for s in range(num_splits):
        part = (first + s) * BLOCK_M + local
        scale = tl.exp(tl.load(part_ml_ptr + part * 2) - m_safe)
        total += tl.load(part_ml_ptr + part * 2 + 1) * scale
        acc += tl.load(part_o_ptr + part[:, None] * BLOCK_D + d[None, :]) * scale[:, None]
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    rows = block * BLOCK_M + local
    t = rows // G
    g = rows % G
    ok = (rows < G * T)[:, None] & (d < D)[None, :]
    tl.store(out_ptr + b * stride_ob + t[:, None] * stride_ot + (h * G + g)[:, None] * stride_oh
             + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=ok)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   cache_lens: torch.Tensor, new_mask: torch.Tensor | None, key_len: int) -> torch.Tensor:
    """Attention of T new tokens per request over its slot's live keys.

    Parameters
    ----------
    q : the new tokens' queries, roped.
    k_cache, v_cache : one layer's cache, the new tokens' K/V already written at cache_lens + j.
    slots, cache_lens : each request's slot and cached length before the new tokens.
    new_mask : which of the N entries after the prefix each new token sees (None: causal, N = T).
    key_len : an upper bound on cache_lens + N (host int; sizes the grid, e.g. the cache length
        under a CUDA graph): keys past each request's own cache_lens + N are never read.

    Shape:
        q: (B, Hq, T, D); k_cache, v_cache: (slots, Hkv, max_len, D); slots, cache_lens: (B,) int64;
        new_mask: (B, T, N) bool or None -> (B, T, Hq, D) in q's dtype.
    """
    check_tensor("q", q, None, 4)
    check_tensor("k_cache", k_cache, q.dtype, 4)
    check_tensor("v_cache", v_cache, q.dtype, 4)
    check_tensor("slots", slots, torch.int64, 1)
    check_tensor("cache_lens", cache_lens, torch.int64, 1)
    if new_mask is not None:
        check_tensor("new_mask", new_mask, torch.bool, 3)
    check_same_device(q=q, k_cache=k_cache, slots=slots, cache_lens=cache_lens)
    if q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"q: {q.shape[1]} query heads are not a multiple of {k_cache.shape[1]} KV heads")
    return torch.ops.specserve.tree_attention(q, k_cache, v_cache, slots, cache_lens, new_mask, key_len)


@torch.library.custom_op("specserve::tree_attention", mutates_args=())
def _tree_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                       cache_lens: torch.Tensor, new_mask: torch.Tensor | None, key_len: int) -> torch.Tensor:
    if not use_triton(q):
        return tree_attention_reference(q, k_cache, v_cache, slots, cache_lens, new_mask)
    b, hq, t, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    out = torch.empty(b, t, hq, d, dtype=q.dtype, device=q.device)
    tiles = _tiles(g * t, d, q.dtype)
    block_d = max(16, triton.next_power_of_2(d))
    row_blocks = triton.cdiv(g * t, tiles.block_m)
    split_len, num_splits = _splits(min(key_len, k_cache.shape[2]), row_blocks)
    part_o = torch.empty(b * hkv, row_blocks, num_splits, tiles.block_m, block_d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(b * hkv, row_blocks, num_splits, tiles.block_m, 2, dtype=torch.float32, device=q.device)
    mask = new_mask.view(torch.uint8) if new_mask is not None else cache_lens  # any tensor when unused
    mask_strides = new_mask.stride() if new_mask is not None else (0, 0, 0)
    _tree_attention_split_kernel[(b * hkv, row_blocks, num_splits)](
        q, k_cache, v_cache, slots, cache_lens, mask, part_o, part_ml,
        t, new_mask.shape[2] if new_mask is not None else t, hkv, split_len, d**-0.5,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *mask_strides,
        G=g, D=d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=block_d, HAS_MASK=new_mask is not None,
        DOT_F32=q.dtype == torch.float32 or interpreting(), num_warps=4,
    )
    _tree_attention_merge_kernel[(b * hkv, row_blocks)](
        part_o, part_ml, out, t, hkv, num_splits, *out.stride(),
        G=g, D=d, BLOCK_M=tiles.block_m, BLOCK_D=block_d,
    )
    return out


@_tree_attention_op.register_fake
def _(q, k_cache, v_cache, slots, cache_lens, new_mask, key_len):  # noqa: ANN001, ANN202
    b, hq, t, d = q.shape
    return q.new_empty(b, t, hq, d)


def tree_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                             cache_lens: torch.Tensor, new_mask: torch.Tensor | None) -> torch.Tensor:
    """Plain-PyTorch `tree_attention` over every key of the slots, masked, softmax in fp32."""
    b, hq, t, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    keys, values = k_cache[slots].float(), v_cache[slots].float()  # (B, Hkv, S, D)
    if new_mask is None:
        new_mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril().expand(b, t, t)
    n = new_mask.shape[2]
    rel = torch.arange(s, device=q.device)[None, :] - cache_lens[:, None]  # (B, S)
    new = torch.gather(new_mask, 2, rel.clamp(0, n - 1)[:, None, :].expand(b, t, s))  # (B, T, S)
    visible = (rel < 0)[:, None, :] | ((rel >= 0) & (rel < n))[:, None, :] & new  # (B, T, S)
    scores = q.float().reshape(b, hkv, g * t, d) @ keys.transpose(-1, -2) * d**-0.5  # (B, Hkv, G*T, S)
    scores = scores.view(b, hkv, g, t, s).masked_fill(~visible[:, None, None], float("-inf"))
    probs = scores.view(b, hkv, g * t, s).softmax(-1)
    out = (probs @ values).view(b, hq, t, d)  # (B, Hq, T, D)
    return out.transpose(1, 2).to(q.dtype).contiguous()
