"""Prompt chunks of several requests in one target forward, without padding.

A prefill computes, for each of a few requests, its prompt positions [start, end) after the
`start` positions its slot holds already (reused from the prefix cache, or earlier chunks of the
same prompt). The chunks are packed into one row of N = sum(end - start) tokens: every linear
layer multiplies N rows and none of them is padding; each token's K/V goes to its own request's
slot (the model writes per-token `write_slots`), and attention runs chunk by chunk over that
slot's keys [0, end), causal after the prefix (`PackedAttention`). Logits are computed at each
chunk's last position only.

This module does not choose the chunks (the engine does, within `max_num_batched_tokens`), sample,
or know about drafters; `TargetRunner.prefill` decides between this forward and the CPU's compiled
program.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from specserve.models.attention import AttentionInputs
from specserve.models.cpu_linear import padded_rows
from specserve.models.kv_cache import KVCache
from specserve.models.llama import ForwardOutput, LlamaModel
from specserve.staging import to_device


@dataclass(frozen=True)
class PromptChunk:
    """The prompt positions [start, start + len(tokens)) of the request in `slot`; the slot holds
    the positions below `start` already."""

    slot: int
    start: int
    tokens: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class PackedPrompts:
    """Chunks in one forward: chunk i's tokens are the columns [offsets[i], offsets[i + 1])."""

    chunks: tuple[PromptChunk, ...]
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, chunks: Sequence[PromptChunk]) -> PackedPrompts:
        offsets = [0]
        for c in chunks:
            offsets.append(offsets[-1] + len(c.tokens))
        return cls(tuple(chunks), tuple(offsets))

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    def columns(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i + 1])

    @property
    def last_columns(self) -> list[int]:
        """Each chunk's last column (its logits row)."""
        return [z - 1 for z in self.offsets[1:]]


def split_packs(chunks: Sequence[PromptChunk], max_tokens: int) -> list[PackedPrompts]:
    """Consecutive chunks grouped into forwards of at most `max_tokens` tokens each (a longer
    chunk goes alone): one forward's inputs must fit the staging ring."""
    packs: list[list[PromptChunk]] = [[]]
    size = 0
    for c in chunks:
        if packs[-1] and size + len(c.tokens) > max_tokens:
            packs.append([])
            size = 0
        packs[-1].append(c)
        size += len(c.tokens)
    return [PackedPrompts.of(p) for p in packs if p]


class PackedAttention:
    """An attention backend for one packed forward: per chunk, SDPA of its queries over its slot's
    keys [0, end): causal for a fresh prompt; after a prefix, causal aligned to the last key (the
    whole prefix and the chunk causally): on CUDA `causal_lower_right`, which flash attention runs
    without a mask in memory, elsewhere a mask built once per forward. On a CPU each chunk's
    queries and keys are padded to `padded_rows` sizes (oneDNN keeps memory for every shape it
    meets; `runtime.compiled`); the padded queries are dropped, no real query sees a padded key."""

    name = "packed"
    needs_prepare = False
    reads_mask = False

    def __init__(self, packed: PackedPrompts, device: torch.device, max_len: int) -> None:
        """max_len: the cache's entries per slot (padded keys stay within the slot)."""
        self.spans = []  # (slot, queries run (padded), keys read, the chunk's columns, mask; None: causal)
        for i, c in enumerate(packed.chunks):
            t, cols = len(c.tokens), packed.columns(i)
            if device.type == "cuda":
                self.spans.append((c.slot, t, c.end, cols, None if c.start == 0 else lower_right(t, c.end, device)))
            elif c.start == 0:  # queries and keys padded alike: causal keeps every real query on real keys
                rows = min(padded_rows(t), max_len)
                self.spans.append((c.slot, rows, rows, cols, None))
            else:
                rows, keys = padded_rows(t), min(padded_rows(c.end), max_len)
                self.spans.append((c.slot, rows, keys, cols, lower_right(t, c.end, device, rows, keys)))

    def prepare(self, a: AttentionInputs, host_cache_lens: list[int]) -> None:
        return None

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, a: AttentionInputs) -> torch.Tensor:
        """q (1, Hq, N, D) -> (1, N, Hq * D)."""
        outs = []
        for slot, rows, end, cols, mask in self.spans:
            queries = q[:, :, cols]
            t = queries.shape[2]
            queries = F.pad(queries, (0, 0, 0, rows - t))  # padded queries: zeros, dropped below
            # views (1, Hkv, end, D)
            keys, values = k_cache[slot : slot + 1, :, :end], v_cache[slot : slot + 1, :, :end]
            keys, values = keys.to(q.dtype), values.to(q.dtype)  # a narrower cache (kv_cache_dtype) widened
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=mask is None,
                                                 enable_gqa=True)
            outs.append(out[:, :, :t])
        out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # (1, Hq, N, D)
        return out.transpose(1, 2).reshape(1, q.shape[2], -1)


def lower_right(t: int, s: int, device: torch.device, rows: int | None = None, keys: int | None = None) -> torch.Tensor:
    """The mask of t new tokens after s - t cached ones: key j visible to new token i when
    j <= s - t + i. On CUDA a `CausalBias` (no (t, s) tensor), else that bool tensor, of `rows`
    x `keys` when padded (padded keys are past every real query's last key)."""
    if device.type == "cuda":
        return causal_lower_right(t, s)
    rows, keys = rows or t, keys or s
    return torch.arange(keys, device=device)[None, :] <= (s - t) + torch.arange(rows, device=device)[:, None]


def packed_forward(model: LlamaModel, cache: KVCache, packed: PackedPrompts,
                   aux_layers: tuple[int, ...] = ()) -> ForwardOutput:
    """One eager forward over the packed chunks -> logits (1, K, V) at each chunk's last position,
    hidden (1, N, H) and aux (1, N, A) over every column."""
    dev = cache.data.device
    tokens, positions, slots = [], [], []
    for c in packed.chunks:
        tokens += c.tokens
        positions += range(c.start, c.end)
        slots += [c.slot] * len(c.tokens)
    staged = to_device([tokens, positions, slots], dev)  # (3, N)
    tokens_t, positions_t, slots_t = staged[0:1], staged[1:2], staged[2:3]  # (1, N) each
    last = to_device(packed.last_columns, dev)[None]  # (1, K)
    cos, sin = model.rope
    a = AttentionInputs(
        slots=slots_t[:, 0], cache_lens=positions_t[:, 0], write_slots=slots_t, write_pos=positions_t,
        key_len=max(c.end for c in packed.chunks), mask=None, is_causal=False, slot_range=None,
        cos=cos[positions_t].unsqueeze(2), sin=sin[positions_t].unsqueeze(2),
        backend=PackedAttention(packed, dev, cache.max_len),
    )
    return model(tokens_t, a, cache, logit_index=last, aux_layers=aux_layers)


def concat_outputs(outs: Sequence[ForwardOutput]) -> ForwardOutput:
    """Forwards of single chunks, side by side as one packed output (columns in order)."""
    if len(outs) == 1:
        return outs[0]
    aux = None if outs[0].aux_hidden is None else torch.cat([o.aux_hidden for o in outs], dim=1)
    return ForwardOutput(logits=torch.cat([o.logits for o in outs], dim=1),
                         hidden=torch.cat([o.hidden for o in outs], dim=1), aux_hidden=aux)
