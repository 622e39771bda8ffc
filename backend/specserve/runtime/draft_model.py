"""A standalone draft model's forwards over its own KV cache: catch-ups and beam steps.

`DraftModelRunner` runs every forward of a draft LLM (`drafters.standalone`): `write_kv` over
tokens whose K/V the draft cache lacks (a prompt chunk: the layers alone, no logits) and `forward`
for the logits a draft needs (the catch-up up to the root, then each beam step). Tokens are
written at arbitrary entries of their slots (`write_pos`: a beam's scratch area) with rope at
`positions`. On a CPU with compiled programs (`RuntimePlan.compile_cache_dir`) the layers run as
one AOTInductor program (`CompiledDraftModel`, called as a draft head's is) and the logits come
from the model's own output layer at the columns asked for; elsewhere, and for forwards the program
does not cover, they run eagerly with torch attention. No CUDA graph is captured for a draft LLM.

This module does not draft: it neither picks tokens nor tracks what each slot has cached.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specserve.models.attention import AttentionInputs
from specserve.models.kv_cache import KVCache
from specserve.models.llama import KeyMask, LlamaModel, scattered_attention_inputs
from specserve.runtime.compiled import (
    KEY_ALIGN,
    PREFILL_CONFIGS,
    aligned_keys,
    compiled_or_none,
    load_or_compile,
    prefix_keys,
    prefix_then_new,
    program_key,
    readonly_attend,
    scattered_call,
)
from specserve.runtime.plan import RuntimePlan
from specserve.staging import to_device


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
        key = program_key(model.state_dict().items(), "draft model", tuple(cache.data.shape))
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
    `compiled` its CPU program where the plan compiles (None otherwise). Build it before the
    model's linears are prepacked for eager use."""

    def __init__(self, model: LlamaModel, cache: KVCache, plan: RuntimePlan | None = None) -> None:
        self.model, self.cache = model, cache
        cache_dir = None if plan is None else plan.compile_cache_dir
        self.compiled = None if cache_dir is None else compiled_or_none(
            "draft model", lambda: CompiledDraftModel(model, cache, cache_dir))

    def _inputs(self, positions: torch.Tensor, write_pos: torch.Tensor, slots: list[int], mask: KeyMask | None,
                key_len: int) -> AttentionInputs:
        return scattered_attention_inputs(self.model.rope, positions, write_pos, slots, mask, key_len)

    def _compiled(self, tokens: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor, slots: list[int],
                  mask: KeyMask | None, key_len: int) -> torch.Tensor | None:
        """The program's hidden (B, T, H) with the new K/V written, or None where it does not run."""
        if self.compiled is None or not self.compiled.fits(key_len):
            return None
        b, t = tokens.shape
        if mask is None:  # causal over a fresh prefill: nothing before the new tokens
            mask = KeyMask(torch.zeros(b, dtype=torch.int64, device=tokens.device))
        return self.compiled.forward(tokens, positions, write_pos, mask.dense(t, key_len),
                                     to_device(slots, tokens.device))

    def write_kv(self, tokens: torch.Tensor, positions: torch.Tensor, slots: list[int], mask: KeyMask | None,
                 key_len: int) -> None:
        """tokens, positions (B, T), written at their positions; mask: the keys each token sees
        (None: causal over a fresh prefill). Only their K/V come out: no logits are computed."""
        if self._compiled(tokens, positions, positions, slots, mask, key_len) is not None:
            return
        a = self._inputs(positions, positions, slots, mask, key_len)
        self.model.run_layers(tokens, lambda i, attn, x: attn(x, self.cache.layer(i), a))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor, slots: list[int],
                mask: KeyMask | None, key_len: int, logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions, write_pos (B, T); logit_index (B, K): the columns that get logits
        (all T when None) -> logits (B, K, V)."""
        hidden = self._compiled(tokens, positions, write_pos, slots, mask, key_len)
        if hidden is not None:
            return self.model.output(hidden, None, logit_index).logits
        a = self._inputs(positions, write_pos, slots, mask, key_len)
        return self.model(tokens, a, self.cache, logit_index=logit_index).logits
