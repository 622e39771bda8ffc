"""The fused layer kernels against their references (the eager ops they replace)."""

import pytest
import torch

from specserve.models.llama import apply_rope, rope_table
from specserve_kernels import (
    add_rms_norm,
    add_rms_norm_reference,
    rope_kv_write,
    rope_kv_write_reference,
    silu_mul,
    silu_mul_reference,
)

DTYPES = [torch.float32, torch.bfloat16]


def _close(got, want, dtype):
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 5, 96), (2, 7, 576)])
def test_add_rms_norm(kernel_device, dtype, shape):
    g = torch.Generator().manual_seed(shape[-1])
    x, d = (torch.randn(shape, generator=g).to(dtype).to(kernel_device) for _ in range(2))
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(kernel_device)
    got, want = add_rms_norm(x, d, w, 1e-5), add_rms_norm_reference(x, d, w, 1e-5)
    torch.testing.assert_close(got[0], want[0])  # the sum rounds exactly as eager
    _close(got[1], want[1], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d", "b", "t"), [(4, 2, 16, 1, 1), (9, 3, 64, 3, 5), (2, 2, 24, 2, 4)])
def test_rope_kv_write(kernel_device, dtype, hq, hkv, d, b, t):
    from specserve.model_config import ModelConfig

    g = torch.Generator().manual_seed(hq * d + t)
    cfg = ModelConfig(vocab_size=10, hidden_size=hq * d, intermediate_size=8, num_layers=1, num_heads=hq,
                      num_kv_heads=hkv, head_dim=d, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=64, tie_word_embeddings=False)
    cos_t, sin_t = rope_table(cfg, 64, dtype)
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    positions = torch.randint(0, 64, (b, t), generator=g)
    cos, sin = cos_t[positions].unsqueeze(2), sin_t[positions].unsqueeze(2)
    slots = torch.randperm(b + 2, generator=g)[:b][:, None].expand(b, t)
    pos = torch.randint(0, 40 - t, (b, 1), generator=g) + torch.arange(t)
    caches = [torch.zeros(b + 2, hkv, 40, d, dtype=dtype) for _ in range(4)]
    ref_q = rope_kv_write_reference(qkv, cos, sin, caches[0], caches[1], slots, pos, hq, hkv)
    dev = kernel_device
    k, v = caches[2].to(dev), caches[3].to(dev)
    q = rope_kv_write(qkv.to(dev), cos.to(dev), sin.to(dev), k, v, slots.to(dev), pos.to(dev), hq, hkv)
    assert q.shape == (b, hq, t, d)
    # rounds where eager rounds: equal, except under the interpreter in bf16 (its float32 -> bfloat16
    # conversion truncates where a GPU rounds to nearest even)
    tol = {} if dtype == torch.float32 or dev.type == "cuda" else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(q.transpose(1, 2).cpu(), ref_q, **tol)
    torch.testing.assert_close(k.cpu(), caches[0], **tol)
    torch.testing.assert_close(v.cpu(), caches[1], rtol=0, atol=0)  # copied
    # the reference is the model's eager RoPE
    qk = qkv[..., : (hq + hkv) * d].view(b, t, hq + hkv, d)
    torch.testing.assert_close(ref_q, apply_rope(qk, cos, sin)[:, :, :hq])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 32), (2, 3, 1536), (4, 2, 2600)])
def test_silu_mul(kernel_device, dtype, shape):
    g = torch.Generator().manual_seed(shape[-1])
    gu = torch.randn(shape, generator=g).to(dtype).to(kernel_device)
    _close(silu_mul(gu), silu_mul_reference(gu), dtype)
