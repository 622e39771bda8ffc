"""The flashinfer backend's mapping of our cache and masks onto flashinfer's paged-KV contract,
checked on CPU against a stand-in wrapper that implements that contract in torch (the documented
semantics of `BatchPrefillWithPagedKVCacheWrapper.plan/run`: CSR pages per request, last-page
length, per-request row-major custom mask, bottom-right-aligned causal). The real kernel is
compared with the torch backend by tests/gpu/ on a GPU.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from specserve.model_config import ModelConfig
from specserve.models.attention import (
    TORCH_ATTENTION,
    TRITON_ATTENTION,
    FlashInferAttention,
    TorchAttention,
    flashinfer_available,
    grouped_attention,
    resolve_attention,
)
from specserve.models.kv_cache import KVCache
from specserve.models.llama import LlamaModel


class PagedPrefillReference:
    """flashinfer's BatchPrefillWithPagedKVCacheWrapper (HND layout), in torch, for tests."""

    def __init__(self, workspace, kv_layout, use_cuda_graph=False, **buffers):
        assert kv_layout == "HND"
        self.plans = []

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             custom_mask=None, causal=False, q_data_type=None, kv_data_type=None):
        self.plans.append(dict(qo_indptr=qo_indptr.tolist(), kv_indptr=kv_indptr.tolist(),
                               kv_indices=kv_indices.tolist(),
                               last_page_len=last_page_len.tolist(), page_size=page_size, causal=causal,
                               custom_mask=None if custom_mask is None else custom_mask.clone()))

    def run(self, q, kv):
        p = self.plans[-1]
        k_pages, v_pages = kv  # (pages, Hkv, page_size, D)
        out, mask_offset = [], 0
        for i in range(len(p["qo_indptr"]) - 1):
            qi = q[p["qo_indptr"][i] : p["qo_indptr"][i + 1]]  # (T, Hq, D)
            pages = p["kv_indices"][p["kv_indptr"][i] : p["kv_indptr"][i + 1]]
            kv_len = (len(pages) - 1) * p["page_size"] + p["last_page_len"][i]
            k = torch.cat([k_pages[j] for j in pages], dim=1)[:, :kv_len]  # (Hkv, S, D)
            v = torch.cat([v_pages[j] for j in pages], dim=1)[:, :kv_len]
            t = qi.shape[0]
            if p["custom_mask"] is not None:
                m = p["custom_mask"][mask_offset : mask_offset + t * kv_len].view(t, kv_len)
                mask_offset += t * kv_len
            elif p["causal"]:
                m = torch.arange(kv_len)[None, :] <= torch.arange(t)[:, None] + kv_len - t
            else:
                m = torch.ones(t, kv_len, dtype=torch.bool)
            o = grouped_attention(qi.transpose(0, 1)[None], k[None], v[None], m[None, None])  # (1, Hq, T, D)
            out.append(o[0].transpose(0, 1))
        return torch.cat(out)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = PagedPrefillReference
    monkeypatch.setitem(sys.modules, "flashinfer", module)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    cfg = ModelConfig.from_dir(tiny_target_dir)
    torch.manual_seed(0)
    model = LlamaModel(cfg).float()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    cache = KVCache(cfg, 4, 96, torch.float32, "cpu")
    model.init_rope(cache.max_len)
    return model, cache


def _run(model, cache, backend, tokens, positions, slots, lens, new_mask):
    a = model.attention_inputs(positions, slots, lens, new_mask, cache, lens.tolist(), slots.tolist(), backend=backend)
    return model(tokens, a, cache).logits


@torch.inference_mode()
@pytest.mark.parametrize("case", ["prefill", "decode_equal", "decode_ragged", "tree"])
def test_flashinfer_mapping_matches_torch(fake_flashinfer, tiny, case):
    model, cache = tiny
    cfg = model.cfg
    fi = FlashInferAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cache.max_len, torch.float32,
                             torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    cache.data.normal_(generator=g)
    slots = torch.tensor([3, 0, 2])
    if case == "prefill":
        lens, t, new_mask = torch.zeros(3, dtype=torch.int64), 7, None
    elif case == "decode_equal":
        lens, t, new_mask = torch.tensor([20, 20, 20]), 1, None
    elif case == "decode_ragged":
        lens, t, new_mask = torch.tensor([20, 5, 61]), 1, None
    else:
        lens, t = torch.tensor([20, 5, 61]), 4
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        new_mask = tree.expand(3, 4, 4)
    tokens = torch.randint(0, cfg.vocab_size, (3, t), generator=g)
    positions = lens[:, None] + torch.arange(t)
    before = cache.data.clone()
    ref = _run(model, cache, TorchAttention(), tokens, positions, slots, lens, new_mask)
    cache.data.copy_(before)
    got = _run(model, cache, fi, tokens, positions, slots, lens, new_mask)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    plan = fi.wrapper.plans[-1]
    assert plan["kv_indices"] == [3, 0, 2] and plan["page_size"] == cache.max_len  # one page per slot
    assert plan["last_page_len"] == (lens + t).tolist()
    assert plan["causal"] == (case == "prefill")


def test_resolve_attention():
    cpu, cuda, bf16 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16
    assert resolve_attention("auto", cpu, bf16) == "torch"
    assert resolve_attention("torch", cpu, bf16) == "torch"
    assert resolve_attention("auto", cuda, torch.float32) == "triton"  # flashinfer has no fp32 kernels
    if not flashinfer_available():
        assert resolve_attention("auto", cuda, bf16) == "triton"
    assert resolve_attention("triton", cpu, bf16) == "triton"  # the kernel's reference: for tests
    with pytest.raises(ValueError, match="^attention_backend: flashinfer needs a CUDA device"):
        resolve_attention("flashinfer", cpu, bf16)
    with pytest.raises(ValueError, match="^attention_backend"):
        resolve_attention("flashinfer", cuda, torch.float32)
    with pytest.raises(ValueError, match="^attention_backend"):
        resolve_attention("xformers", cpu, bf16)


@torch.inference_mode()
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("case", ["prefill", "decode_equal", "decode_ragged", "tree"])
def test_triton_backend_matches_torch(tiny, case, static, monkeypatch):
    """The Triton kernel (under the interpreter) in the model's forward, eager and in the static
    bucketed form CUDA graphs capture, against torch attention."""
    monkeypatch.setenv("SPECSERVE_FORCE_TRITON", "1")
    model, cache = tiny
    g = torch.Generator().manual_seed(2)
    cache.data.normal_(generator=g)
    slots = torch.tensor([3, 0, 2])
    lens, t = torch.tensor([20, 5, 61]), 4
    new_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool).expand(3, 4, 4)
    if case == "prefill":
        lens, t, new_mask = torch.zeros(3, dtype=torch.int64), 7, None
    elif case.startswith("decode"):
        lens, t, new_mask = (torch.tensor([20, 20, 20]) if case == "decode_equal" else lens), 1, None
    tokens = torch.randint(0, model.cfg.vocab_size, (3, t), generator=g)
    positions = lens[:, None] + torch.arange(t)
    before = cache.data.clone()
    ref = _run(model, cache, TORCH_ATTENTION, tokens, positions, slots, lens, new_mask)
    cache.data.copy_(before)
    if static and case != "prefill":
        mask = new_mask if new_mask is not None else torch.ones(3, 1, 1, dtype=torch.bool)
        a = model.static_attention_inputs(positions, slots, lens, mask, cache, TRITON_ATTENTION)
        assert a.mask is None  # the kernel reads live lengths, not a (B, 1, T, S) mask
        got = model(tokens, a, cache).logits
    else:
        got = _run(model, cache, TRITON_ATTENTION, tokens, positions, slots, lens, new_mask)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize("case", ["prefill", "tree"])
def test_fused_gpu_step_matches_eager(tiny, case, monkeypatch):
    """The GPU step's fused kernels (under the interpreter) in the model's forward against its eager ops."""
    monkeypatch.setenv("SPECSERVE_FORCE_TRITON", "1")
    model, cache = tiny
    g = torch.Generator().manual_seed(4)
    cache.data.normal_(generator=g)
    slots = torch.tensor([1, 3])
    if case == "prefill":
        lens, t, new_mask = torch.zeros(2, dtype=torch.int64), 6, None
    else:
        lens, t = torch.tensor([9, 30]), 3
        new_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, t), generator=g)
    positions = lens[:, None] + torch.arange(t)
    before = cache.data.clone()
    ref = model(tokens, model.attention_inputs(positions, slots, lens, new_mask, cache, lens.tolist(), [1, 3],
                                               backend=TRITON_ATTENTION), cache, aux_layers=(1, 4))
    written = cache.data.clone()
    cache.data.copy_(before)
    model.use_fused_kernels()
    try:
        got = model(tokens, model.attention_inputs(positions, slots, lens, new_mask, cache, lens.tolist(), [1, 3],
                                                   backend=TRITON_ATTENTION), cache, aux_layers=(1, 4))
    finally:
        model.use_fused_kernels(False)
    torch.testing.assert_close(cache.data, written, rtol=1e-5, atol=1e-5)
    for name in ("logits", "hidden", "aux_hidden"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-4, atol=1e-4)
