"""Attention over the static KV cache: plain torch (any device), our Triton kernel, or flashinfer (CUDA).

`AttentionInputs` is what every layer of one forward shares. A backend gets one `prepare` per forward
(host side, before the forward or before a CUDA-graph replay) and one `attend` per layer (inside the
forward, capturable). The model writes the new tokens' K/V into the cache before `attend`; a backend
only reads it.

The cache of one layer is (num_slots, num_kv_heads, max_len, head_dim). flashinfer sees it as a
paged cache in its HND layout with one page per slot (page_size = max_len): a request's page
index is its slot and its last-page length is its cache length plus its new tokens.

This module does not choose slots, build masks from trees or capture graphs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

import specserve_kernels as K
from specserve.config import ATTENTION_BACKENDS
from specserve.model_config import ModelConfig
from specserve.models.cpu_linear import EXACT_ROWS, padded_rows

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 * 2**20  # flashinfer's float workspace, as its examples size it


class AttentionBackend(Protocol):
    name: str
    needs_prepare: bool  # False: `prepare` is a no-op and callers may skip building its inputs
    reads_mask: bool  # False: `attend` reads `new_mask` and the cache lengths, not the (B, 1, T, S) mask

    def prepare(self, a: AttentionInputs, host_cache_lens: list[int]) -> None:
        """Host-side preparation for one forward (index buffers, masks); no-op for torch."""

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, a: AttentionInputs) -> torch.Tensor:
        """q (B, Hq, T, D), roped; caches (slots, Hkv, max_len, D) already hold the new K/V
        -> (B, T, Hq * D)."""


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention for a few queries per sequence, GQA without repeating K/V, softmax in fp32.

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D); mask: (B, 1, T, S) bool or None -> (B, Hq, T, D).
    The CUDA path of `TorchAttention` and the reference the CPU path is tested against.
    """
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv  # query heads per K/V head: head h reads K/V head h // g
    scores = (q.reshape(b, hkv, g * t, d) @ k.transpose(-1, -2)).float() * d**-0.5  # (B, Hkv, G*T, S)
    if mask is not None:
        scores = scores.view(b, hkv, g, t, s).masked_fill(~mask[:, :, None], float("-inf")).view(b, hkv, g * t, s)
    probs = scores.softmax(-1)
    return (probs @ v.float()).to(q.dtype).view(b, hq, t, d)


class TorchAttention:
    """SDPA for causal prefill; for decode and tree verification SDPA with the mask on CPU,
    `grouped_attention` on CUDA (its graphs capture it with a static key length).

    Reads each request's keys [0, key_len) of its slot: a view when the slots are consecutive,
    else a gathered copy. Works on every device and inside CUDA graphs (static key_len). On a CPU,
    a forward of more than EXACT_ROWS queries runs them and its keys at `padded_rows` sizes.
    """

    name = "torch"
    needs_prepare = False
    reads_mask = True

    def prepare(self, a: AttentionInputs, host_cache_lens: list[int]) -> None:
        return None

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, a: AttentionInputs) -> torch.Tensor:
        b, _, t, _ = q.shape
        key_len, mask = a.key_len, a.mask
        if q.device.type == "cpu" and t > EXACT_ROWS and (a.is_causal or mask is not None):
            # many queries: padded to `padded_rows` sizes, keys too (oneDNN keeps memory per shape);
            # causal: as many keys as queries, so no real query sees a padded key; else masked off
            rows = min(padded_rows(t), k_cache.shape[2]) if a.is_causal else padded_rows(t)
            key_len = rows if a.is_causal else min(padded_rows(key_len), k_cache.shape[2])
            q = F.pad(q, (0, 0, 0, rows - t))
            if mask is not None:
                mask = F.pad(mask, (0, key_len - a.key_len, 0, rows - t), value=False)
        if a.slot_range is not None:
            first, count = a.slot_range
            keys = k_cache[first : first + count, :, :key_len]  # view: (B, Hkv, S, D)
            values = v_cache[first : first + count, :, :key_len]
        else:
            keys = k_cache[a.slots, :, :key_len]  # gather copy: (B, Hkv, S, D)
            values = v_cache[a.slots, :, :key_len]
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # a narrower cache (kv_cache_dtype) widened
        if a.is_causal:  # prefill of fresh sequences
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
        elif q.device.type == "cpu":  # decode / tree verify: the CPU flash kernel takes the mask and GQA as they are
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        else:  # decode / tree verify on CUDA without flashinfer: few queries against a long prefix
            out = grouped_attention(q, keys, values, a.mask)
        return out[:, :, :t].transpose(1, 2).reshape(b, t, -1)


TORCH_ATTENTION = TorchAttention()  # stateless: one instance serves every model and drafter


class TritonAttention:
    """Decode and tree verification through `specserve_kernels.tree_attention`: bf16 in, fp32
    softmax in registers, only each request's live keys read (inside a CUDA graph too); causal
    prefill of fresh sequences through SDPA. Needs no (B, 1, T, S) mask and no plan."""

    name = "triton"
    needs_prepare = False
    reads_mask = False

    def prepare(self, a: AttentionInputs, host_cache_lens: list[int]) -> None:
        return None

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, a: AttentionInputs) -> torch.Tensor:
        b, _, t, _ = q.shape
        if a.is_causal:
            return TORCH_ATTENTION.attend(q, k_cache, v_cache, a)
        out = K.tree_attention(q, k_cache, v_cache, a.slots, a.cache_lens, a.new_mask, a.key_len)  # (B, T, Hq, D)
        return out.reshape(b, t, -1)


TRITON_ATTENTION = TritonAttention()


@dataclass(frozen=True)
class AttentionInputs:
    """Everything attention needs that is the same for every layer of one forward.

    Shape:
        slots, cache_lens: (B,) int64
        write_slots, write_pos: (B, T) int64, where each new token's K/V goes
        mask: (B, 1, T, S) bool or None (None = causal over fresh, slot-contiguous sequences, or a
            backend that does not read it)
        new_mask: (B, T, T) bool or None (causal): which new tokens each new token sees
        cos, sin: (B, T, 1, D), sin signed (see rope_table)
    """

    slots: torch.Tensor
    cache_lens: torch.Tensor
    write_slots: torch.Tensor
    write_pos: torch.Tensor
    key_len: int  # S: keys read per request, max(cache_lens + T)
    mask: torch.Tensor | None
    is_causal: bool
    slot_range: tuple[int, int] | None  # (first, count) when slots are consecutive: read a view
    cos: torch.Tensor
    sin: torch.Tensor
    backend: AttentionBackend = TORCH_ATTENTION  # planned for these inputs (see attention_backend)
    new_mask: torch.Tensor | None = None


class FlashInferAttention:
    """flashinfer's batch prefill kernel over the paged view of the cache (one page per slot).

    Causal prefill uses `causal=True`; decode and tree verification pass the (B, 1, T, S) mask as
    flashinfer's flattened per-request custom mask (T x kv_len each). With `graph_batch_size`
    set, the wrapper is built in flashinfer's CUDA-graph mode with index and mask buffers for
    exactly that many requests of `graph_num_tokens` tokens; `prepare` refills them before a replay.
    """

    name = "flashinfer"
    needs_prepare = True
    reads_mask = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        graph_batch_size: int | None = None,
        graph_num_tokens: int = 1,
    ) -> None:
        import flashinfer  # the `gpu` extra; `make_attention` checks it is importable

        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.page_size, self.dtype, self.device = max_len, dtype, device
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        if graph_batch_size is None:
            self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
            return
        bs, t = graph_batch_size, graph_num_tokens
        i32 = dict(dtype=torch.int32, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace,
            "HND",
            use_cuda_graph=True,
            qo_indptr_buf=torch.arange(bs + 1, **i32) * t,
            paged_kv_indptr_buf=torch.arange(bs + 1, **i32),
            paged_kv_indices_buf=torch.zeros(bs, **i32),
            paged_kv_last_page_len_buf=torch.ones(bs, **i32),
            # bit-packed per request
            custom_mask_buf=torch.zeros(bs * ((t * max_len + 7) // 8), dtype=torch.uint8, device=device),
            mask_indptr_buf=torch.zeros(bs + 1, **i32),
        )

    def prepare(self, a: AttentionInputs, host_cache_lens: list[int]) -> None:
        b, t = a.write_pos.shape
        kv_lens = torch.tensor(host_cache_lens, dtype=torch.int32) + t  # (B,) keys per request, host
        custom_mask = None  # causal prefill, or one new token seeing every key
        if a.mask is not None:  # flat: request b's (T, kv_len[b]) block, row-major; host-int slices, no sync
            custom_mask = torch.cat([a.mask[i, 0, :, :n].reshape(-1) for i, n in enumerate(kv_lens.tolist())])
        self.wrapper.plan(  # index arrays on the host (flashinfer schedules there), pages and mask on the device
            torch.arange(b + 1, dtype=torch.int32) * t,  # qo_indptr
            torch.arange(b + 1, dtype=torch.int32),  # paged_kv_indptr: one page per request
            a.slots.to(torch.int32),  # paged_kv_indices: the page is the slot
            kv_lens,  # paged_kv_last_page_len
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            custom_mask=custom_mask,
            causal=a.is_causal,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, a: AttentionInputs) -> torch.Tensor:
        b, hq, t, d = q.shape
        out = self.wrapper.run(q.transpose(1, 2).reshape(b * t, hq, d), (k_cache, v_cache))  # (B*T, Hq, D)
        return out.view(b, t, hq * d)


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return False
    return True


def resolve_attention(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """'auto' -> on CUDA flashinfer in fp16/bf16 when it is installed, else our Triton kernel; torch
    on CPU. Raises, naming the field, for a combination that cannot run. (`triton` on a CPU runs
    the kernel's torch reference: for tests.)"""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    usable = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        if device.type != "cuda":
            return "torch"
        return "flashinfer" if usable and flashinfer_available() else "triton"
    if name == "flashinfer" and not (usable and flashinfer_available()):
        raise ValueError(
            "attention_backend: flashinfer needs a CUDA device, dtype bfloat16 or float16, "
            "and the `gpu` extra installed"
        )
    return name


def make_attention_backend(name: str, cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device,
                           graph_batch_size: int | None = None, graph_num_tokens: int = 1) -> AttentionBackend:
    """The backend `name` (resolved) for a model of `cfg` over a cache of `max_len` entries; a
    flashinfer instance is built for one CUDA-graph bucket when graph_batch_size is set."""
    if name == "torch":
        return TORCH_ATTENTION
    if name == "triton":
        return TRITON_ATTENTION
    return FlashInferAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, max_len, dtype, device,
                               graph_batch_size, graph_num_tokens)
