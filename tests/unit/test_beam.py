"""EAGLE-2's beam on the device (`grow_trees_on_device`) picks exactly the host builder's trees."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch

from specserve.drafters.beam import grow_trees, grow_trees_on_device
from specserve.tree import TreeBatch

VOCAB = 40


def make_step(topk: int, on_host: bool, ties: bool):
    """A deterministic stand-in for a draft forward: each beam node's child distribution depends on
    its token, its depth and the state it carries (which adds up its ancestors' tokens)."""

    def step(beam_tokens, parent_state, positions, write_pos, mask, key_len):  # noqa: ANN001, ANN202
        assert mask.dense(beam_tokens.shape[1], key_len).shape[-1] == key_len
        seed = (beam_tokens * 31 + positions * 7 + parent_state[..., 0].long()) % 97  # (B, k)
        logits = torch.sin(seed[..., None].double() * (torch.arange(VOCAB) + 1) * 0.37) * 3
        if ties:  # coarse logits: many equal probabilities, so the index tie-break decides
            logits = logits.round()
        probs, tokens = logits.softmax(-1).float().topk(topk, dim=-1)  # (B, k, k)
        states = parent_state + beam_tokens[..., None]  # (B, k, 1): the beam's states for their children
        return (states, probs, tokens) if not on_host else (states, probs.cpu(), tokens.cpu())

    return step


@pytest.mark.parametrize(("num_steps", "topk", "num_draft_tokens"), [(1, 1, 2), (3, 1, 4), (4, 2, 8), (5, 4, 16),
                                                                       (3, 4, 64), (6, 8, 32)])
@pytest.mark.parametrize("ties", [False, True])
def test_device_beam_builds_the_host_builders_trees(num_steps, topk, num_draft_tokens, ties):
    torch.manual_seed(num_steps * 10 + topk)
    b = 3
    roots = torch.tensor([5, 17, 5])
    seqs = [SimpleNamespace(token_ids=[1, 2, int(r)]) for r in roots]
    base = torch.tensor([3, 9, 6])
    logits = torch.randn(b, VOCAB).round() if ties else torch.randn(b, VOCAB)
    probs, tokens = logits.softmax(-1).topk(topk, dim=-1)
    state = torch.zeros(b, 1)
    key_len = int(base.max()) + (num_steps - 1) * topk + 5
    host = TreeBatch.from_trees(grow_trees(seqs, base, probs, tokens, state, make_step(topk, True, ties),
                                           num_steps, topk, num_draft_tokens))
    device = grow_trees_on_device(roots, base, probs, tokens, state, make_step(topk, False, ties),
                                  num_steps, topk, num_draft_tokens, key_len)
    for f in fields(TreeBatch):
        assert torch.equal(getattr(device, f.name), getattr(host, f.name)), f.name


def test_device_beam_with_fewer_candidates_than_draft_tokens():
    """topk=1, 2 steps: 2 candidates; the tree has 3 nodes whatever num_draft_tokens asks."""
    probs, tokens = torch.tensor([[0.9]]), torch.tensor([[4]])
    tree = grow_trees_on_device(torch.tensor([7]), torch.tensor([2]), probs, tokens, torch.zeros(1, 1),
                                make_step(1, False, False), 2, 1, 8, key_len=8)
    assert tree.tokens.shape == (1, 3) and tree.parents.tolist() == [[-1, 0, 1]]
