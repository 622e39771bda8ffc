import pytest
import torch

from specserve.tree import DraftTree, TreeBatch
from specserve_kernels import build_tree, build_tree_reference

# Two trees padded to N = 6:
#
#   row 0:      0              row 1:   0 - 1 - 2 - 3       (a chain; nodes 4, 5 are padding)
#             / | \
#            1  2  5
#           / \
#          3   4
HAND_PARENTS = torch.tensor([[-1, 0, 0, 1, 1, 0], [-1, 0, 1, 2, -1, -1]])
HAND_DEPTH = torch.tensor([[0, 1, 1, 2, 2, 1], [0, 1, 2, 3, 0, 0]])
HAND_FIRST_CHILD = torch.tensor([[1, 3, -1, -1, -1, -1], [1, 2, 3, -1, -1, -1]])
HAND_NEXT_SIBLING = torch.tensor([[-1, 2, 5, 4, -1, -1], [-1, -1, -1, -1, -1, -1]])
HAND_MASK = torch.tensor(
    [
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 0, 0, 0, 1],
        ],
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [0, 0, 0, 0, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
    ],
    dtype=torch.bool,
)


def assert_same(got, want) -> None:
    for field in ("depth", "mask", "first_child", "next_sibling"):
        torch.testing.assert_close(getattr(got, field).cpu(), getattr(want, field), rtol=0, atol=0, msg=field)


def random_parents(gen: torch.Generator, n: int) -> list[int]:
    """Any tree: each node's parent drawn uniformly from the nodes before it."""
    return [-1] + [int(torch.randint(i, (1,), generator=gen)) for i in range(1, n)]


def test_hand_drawn_tree_reference() -> None:
    got = build_tree_reference(HAND_PARENTS)
    assert_same(got, type(got)(HAND_DEPTH, HAND_MASK, HAND_FIRST_CHILD, HAND_NEXT_SIBLING))


def test_hand_drawn_tree_kernel(kernel_device) -> None:
    got = build_tree(HAND_PARENTS.to(kernel_device))
    assert_same(got, build_tree_reference(HAND_PARENTS))
    assert_same(got, type(got)(HAND_DEPTH, HAND_MASK, HAND_FIRST_CHILD, HAND_NEXT_SIBLING))


@pytest.mark.parametrize("n", [1, 2, 7, 33, 64])
def test_reference_matches_draft_tree(eagle_tree, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    trees = [DraftTree.from_parents([0] * n, random_parents(gen, n)) for _ in range(4)]
    trees += [eagle_tree(gen, topk=4, depth=5, num_draft_tokens=n - 1, vocab_size=32)]
    trees += [DraftTree.chain(0, list(range(1, n)))]  # the deepest tree of n nodes
    got = build_tree_reference(torch.stack([t.parents for t in trees]))
    for b, t in enumerate(trees):
        assert torch.equal(got.depth[b], t.depth)
        assert torch.equal(got.mask[b], t.mask)
        assert torch.equal(got.first_child[b], t.first_child)
        assert torch.equal(got.next_sibling[b], t.next_sibling)


@pytest.mark.parametrize("max_nodes", [1, 5, 16, 64])
def test_kernel_matches_reference(kernel_device, max_nodes: int) -> None:
    gen = torch.Generator().manual_seed(max_nodes)
    sizes = [max_nodes] + [int(torch.randint(1, max_nodes + 1, (1,), generator=gen)) for _ in range(3)]
    batch = TreeBatch.from_trees([DraftTree.from_parents([0] * n, random_parents(gen, n)) for n in sizes])
    got = build_tree(batch.parents.to(kernel_device))
    assert got.mask.dtype == torch.bool
    assert_same(got, build_tree_reference(batch.parents))
    assert_same(got, batch)  # padding nodes: depth 0, only themselves, no links


def test_non_contiguous_input(kernel_device) -> None:
    parents = HAND_PARENTS.t().contiguous().t()  # same values, column-major
    assert_same(build_tree(parents.to(kernel_device)), build_tree_reference(HAND_PARENTS))


@pytest.mark.parametrize(
    ("parents", "match"),
    [
        (torch.tensor([[-1, 0]], dtype=torch.int32), "parents: expected dtype torch.int64"),
        (torch.tensor([-1, 0]), "parents: expected 2 dims"),
        (torch.full((1, 65), -1), "parents: need 1 <= N <= 64"),
        (torch.empty(1, 0, dtype=torch.int64), "parents: need 1 <= N <= 64"),
    ],
)
def test_bad_input(parents: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_tree(parents)
