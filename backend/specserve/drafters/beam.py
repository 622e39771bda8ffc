"""EAGLE-2's beam drafting over a scratch area of a drafter's own KV cache, shared by the
model-based drafters (EAGLE heads, MTP heads, standalone draft LLMs).

Step 0's topk children of each root are given. Each later step runs the drafter once over the
current beam (topk nodes per request, all at rope position `base + step - 1`), writing their K/V to
scratch entries `base + (step-1)*topk + row`; a node sees the request's prefix [0, base) and the
scratch entries of its own ancestors only. `DynamicTreeBuilder` keeps the scores, picks the beam
and does the final rerank. This module runs no model itself: `step` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specserve.model import AttentionInputs, prefix_mask
from specserve.tree import DraftTree, DynamicTreeBuilder

# (beam tokens (B, k), parent states (B, k, ...), positions (B, k), write_pos (B, k), mask (B, 1, k, S), key_len)
#   -> (states (B, k, ...), child probs (B, k, k), child tokens (B, k, k)), probs and tokens on the host
DraftStep = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def scattered_attention_inputs(
    rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, write_pos: torch.Tensor,
    host_slots: list[int], mask: torch.Tensor | None, key_len: int,
) -> AttentionInputs:
    """AttentionInputs for tokens written at arbitrary cache entries `write_pos` (B, T) of their
    slots, with rope `positions` (B, T) and an explicit mask (None: causal over a fresh prefill)."""
    b, t = positions.shape
    slots = torch.tensor(host_slots, device=positions.device)
    first = host_slots[0]
    cos, sin = rope
    return AttentionInputs(
        slots=slots, cache_lens=write_pos[:, 0], write_slots=slots[:, None].expand(b, t), write_pos=write_pos,
        key_len=key_len, mask=mask, is_causal=mask is None,
        slot_range=(first, b) if host_slots == list(range(first, first + b)) else None,
        cos=cos[positions].unsqueeze(2), sin=sin[positions].unsqueeze(2),
    )


def causal_extend_mask(starts: torch.Tensor, t: int, key_len: int) -> torch.Tensor:
    """(B, 1, T, S): T new tokens after each row's prefix [0, starts[b]), causal among themselves."""
    causal = torch.ones(t, t, dtype=torch.bool, device=starts.device).tril().expand(len(starts), t, t)
    return prefix_mask(starts, causal, key_len)


def grow_trees(
    seqs: Sequence, base: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor, state: torch.Tensor,
    step: DraftStep, num_steps: int, topk: int, num_draft_tokens: int,
) -> list[DraftTree]:
    """seqs: the requests (their last token is the root); base (B,): first scratch entry and the
    rope position of depth-1 nodes; probs, tokens (B, k): the roots' children (host);
    state (B, ...): what each root passes to its children (a hidden state, or anything)."""
    b, k, dev = len(seqs), topk, base.device
    builders = [DynamicTreeBuilder(s.token_ids[-1]) for s in seqs]
    columns = []
    for i, builder in enumerate(builders):
        builder.expand(tokens[i : i + 1], probs[i : i + 1], k)
        columns.append([node - 1 for node in builder.beam])
    beam_tokens = torch.gather(tokens, 1, torch.tensor(columns, device=tokens.device))  # (B, k)
    parent_state = state[:, None].expand(b, k, *state.shape[1:])
    visible = torch.zeros(b, k, max((num_steps - 1) * k, 1), dtype=torch.bool, device=dev)  # scratch ancestors
    own = torch.arange(k, device=dev)
    for s in range(1, num_steps):
        first = (s - 1) * k  # this step's scratch entries: [first, first + k)
        visible[:, own, first + own] = True
        key_len = int(base.max()) + first + k
        mask = prefix_mask(base, visible[:, :, : first + k], key_len)
        states, probs, tokens = step(beam_tokens.to(dev), parent_state, (base + s - 1)[:, None].expand(b, k),
                                     base[:, None] + first + own, mask, key_len)
        picks = []
        for i, builder in enumerate(builders):
            start = len(builder.tokens)
            builder.expand(tokens[i], probs[i], k)
            picks.append([node - start for node in builder.beam])  # row * k + column
        flat = torch.tensor(picks, device=tokens.device)  # (B, k)
        rows = (flat // k).to(dev)
        beam_tokens = torch.gather(tokens.view(b, k * k), 1, flat)
        parent_state = states[torch.arange(b, device=dev)[:, None], rows]
        visible = torch.gather(visible, 1, rows[:, :, None].expand(-1, -1, visible.shape[-1]))
    return [builder.build(num_draft_tokens) for builder in builders]
