"""A standalone draft model's forwards over its own KV cache: catch-ups and beam steps.

`DraftModelRunner` runs every forward of a draft LLM (`drafters.standalone`): `write_kv` over
tokens whose K/V the draft cache lacks (a prompt chunk: the layers alone, no logits) and `forward`
for the logits a draft needs (the catch-up up to the root, then each beam step). Tokens are
written at arbitrary entries of their slots (`write_pos`: a beam's scratch area) with rope at
`positions`. Every such forward runs eagerly with torch attention, whatever the `RuntimePlan`:
no CUDA-graph bucket and no compiled program is made for a draft LLM.

This module does not draft: it neither picks tokens nor tracks what each slot has cached.
"""

from __future__ import annotations

import torch

from specserve.models.attention import AttentionInputs
from specserve.models.kv_cache import KVCache
from specserve.models.llama import KeyMask, LlamaModel, scattered_attention_inputs


class DraftModelRunner:
    """The draft model's forwards into `cache` (its own, one slot per request like the target's)."""

    def __init__(self, model: LlamaModel, cache: KVCache) -> None:
        self.model, self.cache = model, cache

    def _inputs(self, positions: torch.Tensor, write_pos: torch.Tensor, slots: list[int], mask: KeyMask | None,
                key_len: int) -> AttentionInputs:
        return scattered_attention_inputs(self.model.rope, positions, write_pos, slots, mask, key_len)

    def write_kv(self, tokens: torch.Tensor, positions: torch.Tensor, slots: list[int], mask: KeyMask | None,
                 key_len: int) -> None:
        """tokens, positions (B, T), written at their positions; mask: the keys each token sees
        (None: causal over a fresh prefill). Only their K/V come out: no logits are computed."""
        a = self._inputs(positions, positions, slots, mask, key_len)
        self.model.run_layers(tokens, lambda i, attn, x: attn(x, self.cache.layer(i), a))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor, slots: list[int],
                mask: KeyMask | None, key_len: int, logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions, write_pos (B, T); logit_index (B, K): the columns that get logits
        (all T when None) -> logits (B, K, V)."""
        a = self._inputs(positions, write_pos, slots, mask, key_len)
        return self.model(tokens, a, self.cache, logit_index=logit_index).logits
