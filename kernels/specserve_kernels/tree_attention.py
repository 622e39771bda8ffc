"""Decode and tree-verify attention over the slot KV cache, reading only each request's live keys.

Request b's T new queries (its tree, or one decode token) attend to its slot's prefix
[0, cache_lens[b]) and to the N entries after it where new_mask[b, t, j] (N = T, causal, when there
is no mask; a drafter's beam keeps N >= T scratch entries). The kernel walks keys up to
cache_lens[b] + N only, read from the device: a CUDA graph captured with a static grid still reads
just the live part of a long cache.

Layout of one program (flash-decoding, split over the key axis):

    grid = (B * Hkv, num_splits)     program (b, h, split) covers keys [split * L, (split + 1) * L)
    rows = G * T query rows          the G query heads of KV head h times the T new tokens
    scores (rows, BLOCK_N) in fp32   online softmax -> partial (acc, max, sum) per split
    a second kernel merges the splits and writes (B, T, Hq, D) in the input dtype

Scores and the softmax are float32 in registers; q, K, V and the output stay in their dtype
(bfloat16 on a GPU): no float32 copy of the cache. Exposed as the custom op
`specserve::tree_attention`, so tracing and the capture check see one op with a shape-only fake.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve_kernels._launch import check_same_device, check_tensor, use_triton

SPLIT_KEYS = 256  # keys per split: a long cache is read by several programs per request and head


@triton.jit
def _tree_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, mask_ptr, part_o_ptr, part_ml_ptr,
    T, N, HKV, split_len, sm_scale,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_ks, stride_kh, stride_kn, stride_kd,
    stride_vs, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mt, stride_mj,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_MASK: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    slot = tl.load(slots_ptr + b)
    cache_len = tl.load(lens_ptr + b).to(tl.int32)  # loop bounds in one integer type
    kv_len = cache_len + N
    rows = tl.arange(0, BLOCK_M)
    g = rows // T  # query head within the group
    t = rows % T  # new token
    row_ok = rows < G * T
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
    part = (pid * NUM_SPLITS + split) * BLOCK_M + rows  # (B * Hkv, splits, BLOCK_M) rows
    tl.store(part_o_ptr + part[:, None] * BLOCK_D + d[None, :], acc)
    tl.store(part_ml_ptr + part * 2, m_i)
    tl.store(part_ml_ptr + part * 2 + 1, l_i)


@triton.jit
def _tree_attention_merge_kernel(
    part_o_ptr, part_ml_ptr, out_ptr, T, HKV,
    stride_ob, stride_ot, stride_oh, stride_od,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // HKV
    h = pid % HKV
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(part_ml_ptr + ((pid * NUM_SPLITS + s) * BLOCK_M + rows) * 2))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for s in range(NUM_SPLITS):
        part = (pid * NUM_SPLITS + s) * BLOCK_M + rows
        scale = tl.exp(tl.load(part_ml_ptr + part * 2) - m_safe)
        total += tl.load(part_ml_ptr + part * 2 + 1) * scale
        acc += tl.load(part_o_ptr + part[:, None] * BLOCK_D + d[None, :]) * scale[:, None]
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    g = rows // T
    t = rows % T
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
    block_m = max(16, triton.next_power_of_2(g * t))
    block_d = max(16, triton.next_power_of_2(d))
    num_splits = triton.cdiv(min(key_len, k_cache.shape[2]), SPLIT_KEYS)
    part_o = torch.empty(b * hkv, num_splits, block_m, block_d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(b * hkv, num_splits, block_m, 2, dtype=torch.float32, device=q.device)
    mask = new_mask.view(torch.uint8) if new_mask is not None else cache_lens  # any tensor when unused
    mask_strides = new_mask.stride() if new_mask is not None else (0, 0, 0)
    _tree_attention_split_kernel[(b * hkv, num_splits)](
        q, k_cache, v_cache, slots, cache_lens, mask, part_o, part_ml,
        t, new_mask.shape[2] if new_mask is not None else t, hkv, SPLIT_KEYS, d**-0.5,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *mask_strides,
        G=g, D=d, BLOCK_M=block_m, BLOCK_N=64 if block_m <= 32 else 32, BLOCK_D=block_d,
        HAS_MASK=new_mask is not None, NUM_SPLITS=num_splits, DOT_F32=q.dtype == torch.float32 or not q.is_cuda,
    )
    _tree_attention_merge_kernel[(b * hkv,)](
        part_o, part_ml, out, t, hkv, *out.stride(),
        G=g, D=d, BLOCK_M=block_m, BLOCK_D=block_d, NUM_SPLITS=num_splits,
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
