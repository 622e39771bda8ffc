from dataclasses import fields

import pytest
import torch

from specserve.tree import DraftTree, DynamicTreeBuilder, TreeBatch


def test_hand_drawn_tree():
    #        r(0)
    #       /    \
    #     a(1)   b(2)
    #     /  \      \
    #   c(3) d(4)   e(5)
    #    |
    #   f(6)
    tree = DraftTree.from_parents([10, 11, 12, 13, 14, 15, 16], [-1, 0, 0, 1, 1, 2, 3])
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.first_child.tolist() == [1, 3, 5, 6, -1, -1, -1]
    assert tree.next_sibling.tolist() == [-1, 2, -1, 4, -1, -1, -1]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.mask, expected)


def test_chain_and_root_only():
    chain = DraftTree.chain(5, [6, 7])
    assert chain.parents.tolist() == [-1, 0, 1]
    assert torch.equal(chain.mask, torch.ones(3, 3, dtype=torch.bool).tril())
    root = DraftTree.root_only(9)
    assert root.num_draft_tokens == 1 and root.first_child.tolist() == [-1]


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 0, 3, 1], []])
def test_bad_parents_are_rejected(parents):
    with pytest.raises(ValueError, match="tree"):
        DraftTree.from_parents(list(range(len(parents))), parents)


def test_batch_padding_sees_only_itself():
    batch = TreeBatch.from_trees([DraftTree.chain(1, [2, 3]), DraftTree.root_only(4)])
    assert batch.tokens.shape == (2, 3)
    assert batch.num_draft_tokens.tolist() == [3, 1]
    assert torch.equal(batch.mask[1], torch.eye(3, dtype=torch.bool))
    assert batch.first_child[1].tolist() == [-1, -1, -1]


def _toy_drafter(prefix_token: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic 'drafter': after token t it proposes t+1.. with decaying probabilities."""
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])[:topk]
    return torch.arange(1, topk + 1) + prefix_token * 10, probs


def test_dynamic_tree_matches_a_hand_computed_eagle2_tree():
    builder = DynamicTreeBuilder(root=0)
    tokens, probs = _toy_drafter(0, 2)
    beam = builder.expand(tokens[None], probs[None], topk=2)  # nodes 1 (0.6), 2 (0.25)
    assert beam == [1, 2]
    rows = [_toy_drafter(builder.tokens[n], 2) for n in beam]
    beam = builder.expand(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]), topk=2)
    # children scores: 0.36, 0.15 (under node 1), 0.15, 0.0625 (under node 2); best two: 3, then 4 (tie -> older)
    assert beam == [3, 4]
    tree = builder.build(num_draft_tokens=5)
    # kept, in rank order: 1 (0.6), 3 (0.36), 2 (0.25), 4 (0.15); node 5 (0.15) loses the tie to 4
    assert tree.tokens.tolist() == [0, 1, 11, 2, 12]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 1]


def test_dynamic_tree_keeps_parents_of_kept_nodes():
    torch.manual_seed(0)
    builder = DynamicTreeBuilder(root=7)
    beam = builder.expand(torch.randperm(50)[:4][None], torch.rand(1, 4), topk=4)
    for _ in range(4):
        beam = builder.expand(torch.stack([torch.randperm(50)[:4] for _ in beam]), torch.rand(len(beam), 4), topk=4)
    for n in (2, 5, 8, 16):
        tree = builder.build(num_draft_tokens=n)
        assert tree.num_draft_tokens == n
        assert all(0 <= p < i for i, p in enumerate(tree.parents.tolist()) if i > 0)


def test_a_smaller_budget_keeps_a_prefix_of_a_larger_budgets_tree():
    """What lets one verify measure the acceptance of every smaller shape (`ShapeChooser.observe`)."""
    torch.manual_seed(1)
    builder = DynamicTreeBuilder(root=3)
    beam = builder.expand(torch.randperm(50)[:4][None], torch.rand(1, 4), topk=4)
    for _ in range(3):
        beam = builder.expand(torch.stack([torch.randperm(50)[:4] for _ in beam]), torch.rand(len(beam), 4), topk=4)
    big = builder.build(num_draft_tokens=12)
    for n in (2, 3, 4, 6, 8):
        small = builder.build(num_draft_tokens=n)
        assert small.tokens.tolist() == big.tokens[:n].tolist()
        assert small.parents.tolist() == big.parents[:n].tolist()


def test_unbatch_gives_back_the_trees_without_padding():
    trees = [DraftTree.from_parents([5, 6, 7, 8], [-1, 0, 0, 1]), DraftTree.chain(9, [1]), DraftTree.root_only(4)]
    back = TreeBatch.from_trees(trees).unbatch()
    assert [t.num_draft_tokens for t in back] == [4, 2, 1]
    for a, b in zip(trees, back):
        for name in ("tokens", "parents", "depth", "mask", "first_child", "next_sibling"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_a_batch_of_roots_alone_equals_the_batched_root_only_trees():
    roots = [7, 3, 11]
    got = TreeBatch.root_only(torch.tensor(roots))
    want = TreeBatch.from_trees([DraftTree.root_only(r) for r in roots])
    assert got.is_root_only
    for f in fields(TreeBatch):
        assert torch.equal(getattr(got, f.name), getattr(want, f.name)), f.name


def test_a_prefix_of_a_tree_is_the_tree_of_its_first_nodes():
    tree = DraftTree.from_parents([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 2])
    for n in range(1, 7):
        want = DraftTree.from_parents(tree.tokens[:n].tolist(), tree.parents[:n].tolist())
        got = tree.prefix(n)
        for name in ("tokens", "parents", "depth", "mask", "first_child", "next_sibling"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (n, name)
    assert tree.prefix(6) is tree and tree.prefix(10) is tree


def test_a_batchs_prefix_is_the_batch_of_its_trees_prefixes():
    """`TreeBatch.prefix` (on the device, no host read) equals batching each tree's `prefix`."""
    trees = [DraftTree.from_parents([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 2]),
             DraftTree.from_parents([7, 6, 5, 4, 3, 2], [-1, 0, 1, 2, 0, 4])]
    batch = TreeBatch.from_trees(trees)
    for n in range(1, 7):
        want = TreeBatch.from_trees([t.prefix(n) for t in trees])
        got = batch.prefix(n)
        for f in fields(TreeBatch):
            assert torch.equal(getattr(got, f.name), getattr(want, f.name)), (n, f.name)
    assert batch.prefix(6) is batch
