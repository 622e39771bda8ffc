import pytest
import torch

from specserve.tree import DraftTree, TreeBatch


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
    assert root.num_nodes == 1 and root.first_child.tolist() == [-1]


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 0, 3, 1], []])
def test_bad_parents_are_rejected(parents):
    with pytest.raises(ValueError, match="tree"):
        DraftTree.from_parents(list(range(len(parents))), parents)


def test_batch_padding_sees_only_itself():
    batch = TreeBatch.from_trees([DraftTree.chain(1, [2, 3]), DraftTree.root_only(4)])
    assert batch.tokens.shape == (2, 3)
    assert batch.num_nodes.tolist() == [3, 1]
    assert torch.equal(batch.mask[1], torch.eye(3, dtype=torch.bool))
    assert batch.first_child[1].tolist() == [-1, -1, -1]
