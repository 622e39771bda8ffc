"""Fused pieces of a Llama layer for the GPU step, each one kernel where eager PyTorch issues 3-6:

    add_rms_norm   x + delta (rounded to the dtype), then RMSNorm of the sum: (new x, normed)
    rope_kv_write  RoPE on q and k from their tables, k and v written into the slot KV cache: q
    silu_mul       silu(gate) * up from the fused gate/up projection

Each rounds where the eager ops round (the model's dtype after every op, statistics in float32),
so it matches its torch reference up to float32 reduction order. Exposed as custom ops
(`specserve::...`) with shape-only fakes, so tracing and the capture check see one op each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve_kernels._launch import check_same_device, check_tensor, use_triton

# ---- add_rms_norm --------------------------------------------------------------------------------


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, x_out_ptr, y_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < H
    dtype = x_out_ptr.dtype.element_ty
    s = (tl.load(x_ptr + row * H + i, mask=ok, other=0.0).to(tl.float32)
         + tl.load(d_ptr + row * H + i, mask=ok, other=0.0).to(tl.float32)).to(dtype)
    tl.store(x_out_ptr + row * H + i, s, mask=ok)
    sf = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(sf * sf, 0) / H + eps)
    normed = (sf * inv).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * H + i, (normed * w).to(dtype), mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta) * weight), as HF Llama: the sum rounded to the dtype, the norm
    in float32 and rounded, then scaled by the weight in the dtype.

    Shape: x, delta: (..., H) contiguous; weight: (H,) -> both outputs (..., H)."""
    check_tensor("weight", weight, x.dtype, 1)
    check_same_device(x=x, delta=delta, weight=weight)
    return torch.ops.specserve.add_rms_norm(x, delta, weight, eps)


@torch.library.custom_op("specserve::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        return add_rms_norm_reference(x, delta, weight, eps)
    h = x.shape[-1]
    x, delta = x.contiguous(), delta.contiguous()
    x_out, y = torch.empty_like(x), torch.empty_like(x)
    block = triton.next_power_of_2(h)
    _add_rms_norm_kernel[(x.numel() // h,)](x, delta, weight, x_out, y, h, eps, BLOCK=block,
                                             num_warps=min(16, max(1, block // 256)))
    return x_out, y


@_add_rms_norm_op.register_fake
def _(x, delta, weight, eps):  # noqa: ANN001, ANN202
    return torch.empty_like(x), torch.empty_like(x)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + delta
    return s, weight * torch.nn.functional.rms_norm(s.float(), weight.shape, eps=eps).to(s.dtype)


# ---- rope_kv_write -------------------------------------------------------------------------------


# Off: with fusion, sm_90's compiler turns x * c + r * s into mul.bf16 + fma.bf16 (one rounding fewer
# than eager's, a bf16 ulp apart); `compile_check` fails a bf16 fma here.
ROPE_FP_FUSION = False


@triton.jit(do_not_specialize=["T", "stride_slot_row", "stride_pos_row"])  # T, the new tokens, varies per launch
def _rope_kv_write_kernel(
    qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, pos_ptr, q_out_ptr,
    T, stride_qkv_row, stride_cos_row, stride_slot_row, stride_pos_row,
    stride_cs, stride_ch, stride_cn, stride_cd,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (token row, head of q | k | v): rope and store q, or rope k / copy v into the cache."""
    row = tl.program_id(0).to(tl.int64)  # b * T + t
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    half = D // 2
    dtype = q_out_ptr.dtype.element_ty
    x = tl.load(qkv_ptr + row * stride_qkv_row + head * D + d, mask=ok, other=0.0)
    if head < HQ + HKV:  # q or k: x * cos + roll(x, D/2) * signed sin, rounded after each op as eager
        rolled = tl.load(qkv_ptr + row * stride_qkv_row + head * D + (d + half) % D, mask=ok, other=0.0)
        c = tl.load(cos_ptr + row * stride_cos_row + d, mask=ok, other=0.0)
        s = tl.load(sin_ptr + row * stride_cos_row + d, mask=ok, other=0.0)
        a = (x.to(tl.float32) * c.to(tl.float32)).to(dtype)
        r = (rolled.to(tl.float32) * s.to(tl.float32)).to(dtype)
        x = (a.to(tl.float32) + r.to(tl.float32)).to(dtype)
    if head < HQ:
        tl.store(q_out_ptr + (row * HQ + head) * D + d, x, mask=ok)
    else:
        b = row // T
        t = row % T
        slot = tl.load(slots_ptr + b * stride_slot_row + t)
        pos = tl.load(pos_ptr + b * stride_pos_row + t)
        offset = slot * stride_cs + ((head - HQ) % HKV) * stride_ch + pos * stride_cn + d * stride_cd
        if head < HQ + HKV:
            tl.store(k_cache_ptr + offset, x, mask=ok)
        else:
            tl.store(v_cache_ptr + offset, x, mask=ok)


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, write_slots: torch.Tensor, write_pos: torch.Tensor, num_heads: int,
                  num_kv_heads: int) -> torch.Tensor:
    """RoPE on the q and k heads of a fused projection, k and v written into the cache; returns q.

    Shape: qkv: (B, T, (Hq + 2 Hkv) D) rows [q | k | v]; cos, sin (signed, see `rope_table`):
    (B, T, 1, D); caches: (slots, Hkv, max_len, D), k and v with equal strides; write_slots,
    write_pos: (B, T) int64 -> q (B, Hq, T, D) (a transposed view of (B, T, Hq, D))."""
    check_tensor("qkv", qkv, None, 3)
    check_same_device(qkv=qkv, cos=cos, k_cache=k_cache, write_pos=write_pos)
    if k_cache.stride() != v_cache.stride():
        raise ValueError("v_cache: expected the strides of k_cache")
    q = torch.ops.specserve.rope_kv_write(qkv, cos, sin, k_cache, v_cache, write_slots, write_pos, num_heads,
                                          num_kv_heads)
    return q.transpose(1, 2)


@torch.library.custom_op("specserve::rope_kv_write", mutates_args=("k_cache", "v_cache"))
def _rope_kv_write_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, write_slots: torch.Tensor, write_pos: torch.Tensor, num_heads: int,
                      num_kv_heads: int) -> torch.Tensor:
    if not use_triton(qkv):
        return rope_kv_write_reference(qkv, cos, sin, k_cache, v_cache, write_slots, write_pos, num_heads,
                                       num_kv_heads)
    b, t, _ = qkv.shape
    d = k_cache.shape[-1]
    qkv = qkv.contiguous()
    cos2, sin2 = cos.reshape(b * t, d).contiguous(), sin.reshape(b * t, d).contiguous()
    slots, pos = write_slots.contiguous(), write_pos.contiguous()
    q = torch.empty(b, t, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_write_kernel[(b * t, num_heads + 2 * num_kv_heads)](
        qkv, cos2, sin2, k_cache, v_cache, slots, pos, q,
        t, qkv.stride(1), cos2.stride(0), slots.stride(0), pos.stride(0), *k_cache.stride(),
        HQ=num_heads, HKV=num_kv_heads, D=d, BLOCK_D=triton.next_power_of_2(d),
        enable_fp_fusion=ROPE_FP_FUSION,
    )
    return q


@_rope_kv_write_op.register_fake
def _(qkv, cos, sin, k_cache, v_cache, write_slots, write_pos, num_heads, num_kv_heads):  # noqa: ANN001, ANN202
    b, t, _ = qkv.shape
    return qkv.new_empty(b, t, num_heads, k_cache.shape[-1])


def rope_kv_write_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, write_slots: torch.Tensor, write_pos: torch.Tensor,
                            num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The eager ops: rope over q and k heads together, k and v scattered into the cache -> q (B, T, Hq, D)."""
    b, t, _ = qkv.shape
    d = k_cache.shape[-1]
    qk = qkv[..., : (num_heads + num_kv_heads) * d].view(b, t, num_heads + num_kv_heads, d)
    qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
    k_cache[write_slots, :, write_pos] = qk[:, :, num_heads:]
    v_cache[write_slots, :, write_pos] = qkv[..., (num_heads + num_kv_heads) * d :].view(b, t, num_kv_heads, d)
    return qk[:, :, :num_heads].contiguous()


# ---- silu_mul ------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * 2 * N + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * N + N + i, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * N + i, (s * u).to(dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up]. Shape: (..., 2 I) -> (..., I)."""
    check_tensor("gate_up", gate_up, None, gate_up.dim())
    return torch.ops.specserve.silu_mul(gate_up)


@torch.library.custom_op("specserve::silu_mul", mutates_args=())
def _silu_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    if not use_triton(gate_up):
        return silu_mul_reference(gate_up)
    n = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(*gate_up.shape[:-1], n)
    rows = gate_up.numel() // (2 * n)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block)
    return out


@_silu_mul_op.register_fake
def _(gate_up):  # noqa: ANN001, ANN202
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
