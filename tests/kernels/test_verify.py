import math

import pytest
import torch

from specserve.tree import DraftTree, TreeBatch
from specserve_kernels import verify_greedy, verify_greedy_reference, verify_sample, verify_sample_reference
from specserve_kernels.verify_greedy import verify_greedy_host

#        0 (10)            node (token)
#       /      \
#    1 (11)   2 (12)
#      |        |
#    3 (13)   4 (14)
HAND = DraftTree.from_parents([10, 11, 12, 13, 14], [-1, 0, 0, 1, 2])


def as_batch(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tree.tokens[None], tree.first_child[None], tree.next_sibling[None]


def assert_result(got, accepted: list[int], bonus: int) -> None:
    n = got.accepted_nodes.shape[1]
    assert got.accepted_nodes[0].tolist() == accepted + [-1] * (n - len(accepted))
    assert got.accept_length.tolist() == [len(accepted)]
    assert got.bonus_tokens.tolist() == [bonus]


@pytest.fixture(params=["reference", "host", "kernel"])
def greedy(request):
    if request.param == "reference":
        return verify_greedy_reference
    if request.param == "host":
        return verify_greedy_host
    device = request.getfixturevalue("kernel_device")
    return lambda *args: verify_greedy(*(t.to(device) for t in args))


@pytest.fixture(params=["reference", "kernel"])
def sample(request):
    if request.param == "reference":
        return verify_sample_reference
    device = request.getfixturevalue("kernel_device")
    return lambda *args: verify_sample(*(t.to(device) for t in args))


# target_tokens[i] = the target's argmax after node i; 0 where the walk never looks.
@pytest.mark.parametrize(
    ("name", "targets", "accepted", "bonus"),
    [
        ("full accept", {0: 11, 1: 13, 3: 99}, [0, 1, 3], 99),
        ("partial", {0: 11, 1: 50}, [0, 1], 50),
        ("none", {0: 42}, [0], 42),
        ("second sibling matches", {0: 12, 2: 14, 4: 77}, [0, 2, 4], 77),
        ("stops at the matching child's mismatch", {0: 12, 2: 13}, [0, 2], 13),
    ],
)
def test_greedy_hand_cases(greedy, name: str, targets: dict, accepted: list[int], bonus: int) -> None:
    target_tokens = torch.zeros(1, HAND.num_draft_tokens, dtype=torch.int64)
    for node, token in targets.items():
        target_tokens[0, node] = token
    assert_result(greedy(*as_batch(HAND), target_tokens), accepted, bonus)


def test_greedy_root_only(greedy) -> None:
    tree = DraftTree.root_only(5)
    assert_result(greedy(*as_batch(tree), torch.tensor([[8]])), [0], 8)


#        0 (0)       q[0] = [0.1, 0.2, 0.3, 0.4]: children take tokens 1 (mass 0.2) and 2 (0.3)
#       /     \
#    1 (1)   2 (2)   q[1] = [0.7, 0.1, 0.1, 0.1], q[2] = uniform
SAMPLE_TREE = DraftTree.from_parents([0, 1, 2], [-1, 0, 0])
SAMPLE_PROBS = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])


@pytest.mark.parametrize(
    ("coin", "final_coin", "accepted", "bonus"),
    [
        (0.1, 0.5, [0, 1], 0),  # 0.1 < 0.2: accept node 1, a leaf; bonus ~ q[1]: cdf 0.7 > 0.5
        (0.25, 0.6, [0, 2], 2),  # 0.2 <= 0.25 < 0.2 + 0.3: accept node 2; bonus ~ q[2]: cdf 0.75 > 0.6
        (0.6, 0.1, [0], 0),  # reject both; residual [0.1, 0, 0, 0.4]: cdf 0.1 > 0.1 * 0.5
        (0.6, 0.5, [0], 3),  # residual cdf [0.1, 0.1, 0.1, 0.5]: first > 0.25 is token 3
        (0.6, 0.999, [0], 3),
    ],
)
def test_sample_hand_cases(sample, coin: float, final_coin: float, accepted: list[int], bonus: int) -> None:
    coins = torch.tensor([[coin, 0.0, 0.0]])
    got = sample(*as_batch(SAMPLE_TREE), SAMPLE_PROBS[None], coins, torch.tensor([final_coin]))
    assert_result(got, accepted, bonus)


def test_sample_root_only(sample) -> None:
    probs = torch.tensor([[[0.5, 0.0, 0.5]]])
    got = sample(*as_batch(DraftTree.root_only(1)), probs, torch.zeros(1, 1), torch.tensor([0.6]))
    assert_result(got, [0], 2)


def test_sample_zero_residual_falls_back_to_argmax(sample) -> None:
    # The children hold all the mass, but float32 rounding leaves acc = 0.9999999 <= u: every child
    # is rejected, the residual is exactly 0, and the bonus is argmax q[0] (the first maximum).
    tree = DraftTree.from_parents([0, 1, 2, 0], [-1, 0, 0, 0])
    third = 0.3333333
    probs = torch.tensor([third, third, third]).expand(1, 4, 3)
    got = sample(*as_batch(tree), probs, torch.full((1, 4), 0.99999994), torch.tensor([0.5]))
    assert_result(got, [0], 0)


def random_batch(
    gen: torch.Generator,
    eagle_tree,
    batch: int,
    topk: int,
    depth: int,
    num_draft_tokens: int,
    vocab_size: int,
) -> tuple[TreeBatch, torch.Tensor]:
    """B EAGLE-like trees (row sizes differ, so rows are padded) and logits (B, N, V) that favour
    each node's children's tokens (by a factor V), so that walks often go deep."""
    trees = []
    for b in range(batch):  # row 0 has num_draft_tokens drafts (if the tree grows that many)
        k = num_draft_tokens - (b > 0) * int(torch.randint(min(num_draft_tokens, 3) + 1, (1,), generator=gen))
        trees.append(eagle_tree(gen, topk, depth, k, vocab_size))
    tb = TreeBatch.from_trees(trees)
    bsz, n = tb.tokens.shape
    logits = torch.randn(bsz, n, vocab_size, generator=gen)
    rows, nodes = torch.nonzero(tb.parents >= 0, as_tuple=True)  # every (b, non-root real node)
    logits[rows, tb.parents[rows, nodes], tb.tokens[rows, nodes]] += math.log(vocab_size)
    return tb, logits


def sampling_inputs(gen: torch.Generator, tb: TreeBatch, logits: torch.Tensor):
    """Processed target probs (zeros where a top-k cut would put them), coins, final coins."""
    probs = torch.softmax(logits, dim=-1)
    cut = probs.topk(max(1, probs.shape[-1] // 4), dim=-1, largest=False).indices
    probs = probs.scatter(-1, cut, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    bsz, n = tb.tokens.shape
    return probs, torch.rand(bsz, n, generator=gen), torch.rand(bsz, generator=gen)


def assert_same_result(got, want) -> None:
    assert torch.equal(got.accepted_nodes.cpu(), want.accepted_nodes)
    assert torch.equal(got.accept_length.cpu(), want.accept_length)
    assert torch.equal(got.bonus_tokens.cpu(), want.bonus_tokens)


GRID = [
    (batch, topk, depth, num_draft_tokens)
    for batch in (1, 3, 8)
    for topk in (1, 2, 4)
    for depth in (1, 3, 5)
    for num_draft_tokens in (1, 4, 8, 16)
]


@pytest.mark.parametrize(("batch", "topk", "depth", "num_draft_tokens"), GRID)
def test_kernels_match_reference(kernel_device, eagle_tree, batch, topk, depth, num_draft_tokens) -> None:
    gen = torch.Generator().manual_seed(1000 * batch + 100 * topk + 10 * depth + num_draft_tokens)
    tb, logits = random_batch(gen, eagle_tree, batch, topk, depth, num_draft_tokens, vocab_size=64)
    links = (tb.tokens, tb.first_child, tb.next_sibling)
    on_device = [t.to(kernel_device) for t in links]

    target_tokens = logits.argmax(dim=-1)
    want = verify_greedy_reference(*links, target_tokens)
    assert_same_result(verify_greedy(*on_device, target_tokens.to(kernel_device)), want)
    assert_same_result(verify_greedy_host(*links, target_tokens), want)  # what CPU tensors run

    probs, coins, final_coins = sampling_inputs(gen, tb, logits)
    want = verify_sample_reference(*links, probs, coins, final_coins)
    got = verify_sample(*on_device, *(t.to(kernel_device) for t in (probs, coins, final_coins)))
    assert_same_result(got, want)


@pytest.mark.parametrize("max_nodes", [16, 64])
def test_sample_kernel_large_vocab(kernel_device, eagle_tree, max_nodes: int) -> None:
    # V = 1000 spans several BLOCK_V chunks when N = 64 (BLOCK_V = 256).
    gen = torch.Generator().manual_seed(max_nodes)
    tb, logits = random_batch(gen, eagle_tree, 4, 4, 5, max_nodes - 1, vocab_size=1000)
    probs, coins, final_coins = sampling_inputs(gen, tb, logits)
    links = (tb.tokens, tb.first_child, tb.next_sibling)
    want = verify_sample_reference(*links, probs, coins, final_coins)
    got = verify_sample(*(t.to(kernel_device) for t in (*links, probs, coins, final_coins)))
    assert_same_result(got, want)
    assert (want.accept_length > 1).any()


def test_bad_input() -> None:
    links = as_batch(HAND)
    with pytest.raises(ValueError, match="target_tokens: expected shape"):
        verify_greedy(*links, torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="next_sibling: expected dtype torch.int64"):
        verify_greedy(links[0], links[1], links[2].int(), torch.zeros(1, 5, dtype=torch.int64))
    probs = torch.full((1, 5, 8), 1 / 8)
    with pytest.raises(ValueError, match="target_probs: expected dtype torch.float32"):
        verify_sample(*links, probs.double(), torch.zeros(1, 5), torch.zeros(1))
    with pytest.raises(ValueError, match="coins: expected shape"):
        verify_sample(*links, probs, torch.zeros(1, 4), torch.zeros(1))
    with pytest.raises(ValueError, match="final_coins: expected 1 dims"):
        verify_sample(*links, probs, torch.zeros(1, 5), torch.zeros(1, 1))
