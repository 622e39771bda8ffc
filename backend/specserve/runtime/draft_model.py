"""A standalone draft model's forwards over its own KV cache, and its whole draft captured per batch size.

`DraftModelRunner.hidden` runs the draft LLM's layers (`drafters.standalone`) over tokens written
at arbitrary entries of their slots (`write_pos`: a beam's scratch area) with rope at `positions`:
a prompt chunk, the catch-up up to the root, each beam step; `logits` is its output layer. On a
CPU with compiled programs (`RuntimePlan.compile_cache_dir`) the layers run as one AOTInductor
program (`CompiledDraftModel`, called as a draft head's is); elsewhere, and for forwards the program
does not cover, they run eagerly (our Triton attention where the target's uses it). `draft` runs
a drafter's whole beam from a CUDA graph (or its static bucket) when the plan is static and the
shape is the captured one, as a draft head's runner does.

This module does not draft: it neither picks tokens nor tracks what each slot has cached.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from specserve.models.attention import TORCH_ATTENTION, TRITON_ATTENTION
from specserve.models.kv_cache import KVCache
from specserve.models.llama import KeyMask, LlamaModel, scattered_attention_inputs
from specserve.runtime.compile_cache import PREFILL_CONFIGS, compiled_or_none, load_or_compile, program_key
from specserve.runtime.compiled import (
    KEY_ALIGN,
    aligned_keys,
    prefix_keys,
    prefix_then_new,
    readonly_attend,
    scattered_call,
)
from specserve.runtime.cuda_graph import DraftGraphs
from specserve.runtime.plan import RuntimePlan
from specserve.staging import to_device
from specserve.tree import TreeBatch
from specserve_kernels import gguf_gemm

Slots = list[int] | torch.Tensor  # host ints, or a (B,) device tensor (a static draft)
Draft = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], TreeBatch]  # (slots, base, roots) (B,) -> trees


class ReadOnlyDraftForward(nn.Module):
    """What `CompiledDraftModel` exports: the draft model's layers over its own cache.

    forward(tokens (B, T), positions (B, T) rope positions, write_pos (B, T) the cache entries the
    new tokens take, slots (B,), mask (B, 1, T, S) bool over cache entries as if the new tokens
    were written already, kv (L, 2, slots, Hkv, S, D)) -> the final-norm hidden (B, T, H),
    new_kv (B, T, L, 2, Hkv, D)."""

    def __init__(self, model: LlamaModel) -> None:
        super().__init__()
        self.model = model
        cos, sin = model.rope
        self.register_buffer("cos", cos, persistent=False)  # (max_len, D)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = prefix_then_new(mask, write_pos)
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)
        new_kv: list[torch.Tensor] = []
        hidden, _ = self.model.run_layers(
            tokens, lambda i, attn, x: readonly_attend(kv[i], slots, full, cos, sin, new_kv)(attn, x))
        return hidden, torch.stack(new_kv, dim=2)


class CompiledDraftModel:
    """The compiled layers of a draft model with its cache (one program for every batch size, token
    count and context length). Build it before the model's linears are prepacked for eager use."""

    def __init__(self, model: LlamaModel, cache: KVCache, cache_dir: Path) -> None:
        self.model, self.cache = model, cache
        key = program_key(model.state_dict().items(), "draft model", tuple(cache.data.shape),
                          gguf_gemm.activation_digits(model))  # a standalone drafter shares the target's layers
        self.runner, self.compiled_now = load_or_compile(cache_dir / f"draft-{key}.pt2", self._export,
                                                         PREFILL_CONFIGS)

    def _export(self) -> torch.export.ExportedProgram:
        Dim = torch.export.Dim
        batch = Dim("batch", min=1, max=max(2, self.cache.num_slots))
        tokens = Dim("tokens", min=1, max=self.cache.max_len - 1)
        keys = Dim("keys", min=2, max=self.cache.max_len - 1)
        dynamic = ({0: batch, 1: tokens}, {0: batch, 1: tokens}, {0: batch, 1: tokens}, {0: batch},
                   {0: batch, 2: tokens, 3: keys}, {4: keys})
        dev = self.cache.data.device
        b, t = 2, 3  # sizes of 1 would be specialised
        pos = torch.arange(t, device=dev).expand(b, t).contiguous()
        example = (torch.zeros(b, t, dtype=torch.int64, device=dev), pos, pos.clone(),
                   torch.zeros(b, dtype=torch.int64, device=dev),
                   torch.ones(b, 1, t, KEY_ALIGN, dtype=torch.bool, device=dev), prefix_keys(self.cache, KEY_ALIGN))
        return torch.export.export(ReadOnlyDraftForward(self.model).eval(), example, dynamic_shapes=dynamic,
                                   strict=False)

    def fits(self, key_len: int) -> bool:
        """Whether the program covers a forward reading key_len entries (else run it eagerly)."""
        return aligned_keys(key_len) < self.cache.max_len

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor, mask: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
        """As the eager layers over the cache: mask (B, 1, T, key_len) over cache entries, the new
        ones (write_pos) included; writes their K/V. -> the final-norm hidden (B, T, H)."""
        assert self.fits(mask.shape[-1]), "check fits() first"
        return scattered_call(self.runner, self.cache, self.model.rope[0].shape[0], tokens, (), positions, write_pos,
                              mask, slots)


class DraftModelRunner:
    """The draft model's forwards into `cache` (its own, one slot per request like the target's);
    `compiled` its CPU program where the plan compiles (None otherwise); `graphs` its captured
    drafts (None until `capture_drafts` on a static plan). Build it before the model's linears are
    prepacked for eager use."""

    def __init__(self, model: LlamaModel, cache: KVCache, plan: RuntimePlan) -> None:
        self.model, self.cache, self.plan = model, cache, plan
        # its attention: our Triton kernel where the target's runs it (the GPU), else torch
        self.attention = TRITON_ATTENTION if plan.attention == "triton" else TORCH_ATTENTION
        cache_dir = plan.compile_cache_dir
        self.compiled = None if cache_dir is None else compiled_or_none(
            "draft model", lambda: CompiledDraftModel(model, cache, cache_dir))
        self.graphs: DraftGraphs | None = None

    def _compiled(self, tokens: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor, slots: Slots,
                  mask: KeyMask | None, key_len: int) -> torch.Tensor | None:
        """The program's hidden (B, T, H) with the new K/V written, or None where it does not run."""
        if self.compiled is None or not self.compiled.fits(key_len):
            return None
        b, t = tokens.shape
        if mask is None:  # causal over a fresh prefill: nothing before the new tokens
            mask = KeyMask(torch.zeros(b, dtype=torch.int64, device=tokens.device))
        slots_t = slots if isinstance(slots, torch.Tensor) else to_device(slots, tokens.device)
        return self.compiled.forward(tokens, positions, write_pos, mask.dense(t, key_len), slots_t)

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor, slots: Slots,
               mask: KeyMask | None, key_len: int) -> torch.Tensor:
        """tokens, positions, write_pos (B, T), written at write_pos of their slots (host ints, or a
        (B,) device tensor in a static draft); mask: the keys each token sees (None: causal over a
        fresh prefill) -> the final-norm hidden (B, T, H)."""
        hidden = self._compiled(tokens, positions, write_pos, slots, mask, key_len)
        if hidden is not None:
            return hidden
        a = scattered_attention_inputs(self.model.rope, positions, write_pos, slots, mask, key_len, self.attention)
        return self.model.run_layers(tokens, lambda i, attn, x: attn(x, self.cache.layer(i), a))[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) -> the model's logits (..., V) in float32."""
        return self.model.lm_head(hidden).float()

    # ---- whole drafts ---------------------------------------------------------------------------

    def capture_drafts(self, draft: Draft, shape: object) -> None:
        """On a static plan: `draft` (the drafter's draft of `shape` with keys over the whole cache
        slot, tensors only) in one bucket per batch size, captured on CUDA."""
        if self.plan.static:
            self.graphs = DraftGraphs(draft, shape, self.plan.batch_sizes, self.cache.reserve(), self.plan.device,
                                      self.plan.capture)

    def draft(self, shape: object, slots: list[int], base: list[int], roots: list[int]) -> TreeBatch | None:
        """The captured draft's trees when `shape` is the captured one and a bucket holds the
        batch, else None (the drafter drafts eagerly)."""
        return None if self.graphs is None else self.graphs(shape, slots, base, roots)
