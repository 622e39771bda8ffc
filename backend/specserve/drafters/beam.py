"""EAGLE-2's beam drafting over a scratch area of a drafter's own KV cache, shared by the
model-based drafters (EAGLE heads, MTP heads, standalone draft LLMs).

Step 0's topk children of each root are given. Each later step runs the drafter once over the
current beam (topk nodes per request, all at rope position `base + step - 1`), writing their K/V to
scratch entries `base + (step-1)*topk + row`; a node sees the request's prefix [0, base) and the
scratch entries of its own ancestors only. `grow_trees` leaves the scores, beam picks and final
rerank to `DynamicTreeBuilder` on the host; `grow_trees_on_device` makes the same picks with
tensor ops (no host sync, static shapes: what a CUDA graph of the whole draft needs) and returns
a `TreeBatch`; `propose_beam` runs a drafter's captured draft where one holds the batch, else its
eager draft. This module runs no model itself: `step` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import specserve_kernels as K
from specserve.models.llama import KeyMask
from specserve.staging import to_device
from specserve.tree import DraftTree, DynamicTreeBuilder, TreeBatch, scratch_entries

# (beam tokens (B, k), parent states (B, k, ...), positions (B, k), write_pos (B, k), mask (KeyMask), key_len)
#   -> (states (B, k, ...), child probs (B, k, k), child tokens (B, k, k)); probs and tokens on the host
#   for `grow_trees`, on the device for `grow_trees_on_device`
DraftStep = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


# (slots: host ints or a (B,) tensor, base (B,), roots (B,), shape, key_len) -> the B trees
BeamDraft = Callable[..., TreeBatch]
# (shape, slots, base, roots) -> the trees of a captured draft, or None where none holds the shape and batch
CapturedDraft = Callable[[object, list[int], list[int], list[int]], TreeBatch | None]


def propose_beam(seqs: Sequence, shape: object, base: list[int], captured: CapturedDraft, draft: BeamDraft,
                 device: torch.device) -> TreeBatch:
    """A model drafter's trees for `seqs` (their last token is the root): the captured draft where
    it holds the shape and the batch, else `draft` eagerly, its keys cut to the longest prefix and
    the beam's scratch. base: per request, the beam's first scratch entry."""
    slots, roots = [s.slot for s in seqs], [s.token_ids[-1] for s in seqs]
    batch = captured(shape, slots, base, roots)
    if batch is not None:
        return batch
    key_len = max(base) + max(shape.scratch, 1)  # prefix + the beam's scratch
    base_t, roots_t = to_device([base, roots], device)  # (B,) each
    return draft(slots, base_t, roots_t, shape, key_len)


def own_entries(k: int, first: int, width: int, device: torch.device) -> torch.Tensor:
    """(k, W) bool: beam row r's own scratch entry `first + r`, built on the device (writing a
    scalar through a device index would copy it from the host: not capturable)."""
    rows = torch.arange(k, device=device)[:, None]
    return torch.arange(width, device=device)[None, :] == rows + first


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
    beam_tokens = torch.gather(tokens, 1, torch.tensor(columns))  # (B, k), host
    parent_state = state[:, None].expand(b, k, *state.shape[1:])
    # scratch ancestors
    visible = torch.zeros(b, k, max(scratch_entries(num_steps, k), 1), dtype=torch.bool, device=dev)
    own = torch.arange(k, device=dev)
    for s in range(1, num_steps):
        first = (s - 1) * k  # this step's scratch entries: [first, first + k)
        visible = visible | own_entries(k, first, visible.shape[-1], dev)
        key_len = int(base.max()) + first + k
        mask = KeyMask(base, visible[:, :, : first + k])
        states, probs, tokens = step(to_device(beam_tokens, dev), parent_state, (base + s - 1)[:, None].expand(b, k),
                                     base[:, None] + first + own, mask, key_len)
        picks = []
        for i, builder in enumerate(builders):
            start = len(builder.tokens)
            builder.expand(tokens[i], probs[i], k)
            picks.append([node - start for node in builder.beam])  # row * k + column
        flat = torch.tensor(picks)  # (B, k), host
        rows = to_device(flat // k, dev)
        beam_tokens = torch.gather(tokens.view(b, k * k), 1, flat)
        parent_state = states[torch.arange(b, device=dev)[:, None], rows]
        visible = torch.gather(visible, 1, rows[:, :, None].expand(-1, -1, visible.shape[-1]))
    return [builder.build(num_draft_tokens) for builder in builders]


def grow_trees_on_device(
    roots: torch.Tensor, base: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor, state: torch.Tensor,
    step: DraftStep, num_steps: int, topk: int, num_draft_tokens: int, key_len: int,
) -> TreeBatch:
    """`grow_trees` with every choice made by tensor ops on the trees' device: no host sync and
    shapes fixed by (B, topk, num_steps), so a whole draft can be captured in a CUDA graph.

    It picks the same trees as `DynamicTreeBuilder`: cumulative scores in float64 (the builder's
    Python floats), ties broken by node index (stable sorts). roots (B,) root tokens; base (B,) as
    in `grow_trees`; probs, tokens (B, k) the roots' children; `step` returns probs and tokens on
    the device; every draft forward reads `key_len` keys. All B trees get the same node count.
    """
    b, k, dev = roots.shape[0], topk, roots.device
    num = 1 + k + (num_steps - 1) * k * k  # root + step 0's children + k*k candidates per later step
    all_tokens = torch.zeros(b, num, dtype=torch.int64, device=dev)
    all_parents = torch.full((b, num), -1, dtype=torch.int64, device=dev)
    all_scores = torch.ones(b, num, dtype=torch.float64, device=dev)
    all_tokens[:, 0] = roots
    scores = probs.double()  # (B, k)
    all_tokens[:, 1 : 1 + k], all_scores[:, 1 : 1 + k] = tokens, scores
    all_parents[:, 1 : 1 + k].fill_(0)  # not `= 0`: under CUDA that number is a host tensor (no capture)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices  # (B, k): the first beam
    beam_nodes, beam_scores, beam_tokens = 1 + order, scores.gather(1, order), tokens.gather(1, order)
    parent_state = state[:, None].expand(b, k, *state.shape[1:])
    # scratch ancestors
    visible = torch.zeros(b, k, max(scratch_entries(num_steps, k), 1), dtype=torch.bool, device=dev)
    own = torch.arange(k, device=dev)
    batch_rows = torch.arange(b, device=dev)[:, None]
    for s in range(1, num_steps):
        first = (s - 1) * k
        visible = visible | own_entries(k, first, visible.shape[-1], dev)
        mask = KeyMask(base, visible)  # entries after this step's are not written yet: hidden
        states, probs, tokens = step(beam_tokens, parent_state, (base + s - 1)[:, None].expand(b, k),
                                     base[:, None] + first + own, mask, key_len)
        start = 1 + k + (s - 1) * k * k
        cand_scores = (beam_scores[:, :, None] * probs.double()).reshape(b, k * k)  # row-major: row * k + column
        cand_tokens = tokens.reshape(b, k * k)
        all_tokens[:, start : start + k * k] = cand_tokens
        all_parents[:, start : start + k * k] = beam_nodes.repeat_interleave(k, dim=1)
        all_scores[:, start : start + k * k] = cand_scores
        flat = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, :k]  # (B, k)
        rows = flat // k
        beam_nodes, beam_scores, beam_tokens = start + flat, cand_scores.gather(1, flat), cand_tokens.gather(1, flat)
        parent_state = states[batch_rows, rows]
        visible = torch.gather(visible, 1, rows[:, :, None].expand(-1, -1, visible.shape[-1]))
    # rerank: best n - 1 nodes in rank order (a parent outranks its children, so it precedes them:
    # the tree for a smaller num_draft_tokens is a prefix of this one)
    n = min(num_draft_tokens, num)
    kept = torch.sort(all_scores[:, 1:], dim=1, descending=True, stable=True).indices[:, : n - 1] + 1  # (B, n - 1)
    new_index = torch.zeros(b, num, dtype=torch.int64, device=dev)  # old node -> tree node (the root stays 0)
    new_index.scatter_(1, kept, torch.arange(1, n, device=dev).expand(b, n - 1))
    tree_tokens = torch.cat([roots[:, None], all_tokens.gather(1, kept)], dim=1)  # (B, n)
    tree_parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev),
                              new_index.gather(1, all_parents.gather(1, kept))], dim=1)
    t = K.build_tree(tree_parents)
    return TreeBatch(tree_tokens, tree_parents, t.depth, t.mask, t.first_child, t.next_sibling,
                     num_draft_tokens=torch.full((b,), n, dtype=torch.int64, device=dev))
