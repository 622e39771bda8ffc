"""Statistical test that tree speculative sampling is lossless.

A tree step emits the accepted drafts' tokens and then the bonus token. Lossless means every
emitted token follows the target: the first is distributed as q[root]; if it is the token of a
root child c (the draft was accepted), the second is distributed as q[c]; if it came from the
bonus, the step emits nothing more. So the first two tokens (t1, t2 or "none") must follow

    P(t1 = tok(c), t2 = w)  = q[root](tok(c)) * q[c](w)     for each root child c
    P(t1 = v, t2 = none)    = q[root](v)                     for every other token v

The test draws that pair from many independent rows of the reference and bounds the total
variation distance to the exact law; lossy variants of the rule must break the same bound.
"""

import dataclasses
import math
from typing import NamedTuple

import pytest
import torch

from specserve.tree import DraftTree
from specserve_kernels import VerifyResult, verify_sample_reference

V = 12
NONE = V  # the "no second token in this step" cell
NUM_SAMPLES = 200_000

TREES = {
    "chain": DraftTree.from_parents([0, 3, 5, 8], [-1, 0, 1, 2]),
    #         0
    #      /  |  \
    #     3   7   1        tokens; node indices 1, 2, 3
    #    / \   \
    #   2   9   4          nodes 4, 5, 6
    "branching": DraftTree.from_parents([0, 3, 7, 1, 2, 9, 4], [-1, 0, 0, 0, 1, 1, 2]),
    "root_only": DraftTree.root_only(0),
}


class SamplerInputs(NamedTuple):
    draft_tokens: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    target_probs: torch.Tensor
    coins: torch.Tensor
    final_coins: torch.Tensor


def node_probs(tree: DraftTree, seed: int) -> torch.Tensor:
    """A fixed target distribution after each node (N, V): each node's children's tokens are
    favoured so that walks go deep, and one other token gets exactly 0 (as after a top-k cut)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tree.num_draft_tokens, V, generator=gen)
    child = tree.parents >= 0
    logits[tree.parents[child], tree.tokens[child]] += 2.0
    probs = torch.softmax(logits, dim=-1)
    for i in range(tree.num_draft_tokens):
        others = [v for v in range(V) if v not in tree.tokens[tree.parents == i].tolist()]
        probs[i, others[-1]] = 0.0
    return probs / probs.sum(dim=-1, keepdim=True)


def root_children(tree: DraftTree) -> list[int]:
    return torch.nonzero(tree.parents == 0).flatten().tolist()


def exact_joint(tree: DraftTree, probs: torch.Tensor) -> torch.Tensor:
    """(V, V + 1): the target's law of (t1, t2 or NONE)."""
    joint = torch.zeros(V, V + 1, dtype=torch.float64)
    joint[:, NONE] = probs[0]
    for c in root_children(tree):
        t = int(tree.tokens[c])
        joint[t, NONE] = 0.0
        joint[t, :V] = probs[0, t].double() * probs[c].double()
    return joint


def draw(tree: DraftTree, probs: torch.Tensor, seed: int) -> SamplerInputs:
    """NUM_SAMPLES independent rows of the same tree and target, each with its own coins."""
    gen = torch.Generator().manual_seed(seed)
    n = tree.num_draft_tokens
    return SamplerInputs(
        *(t.expand(NUM_SAMPLES, n) for t in (tree.tokens, tree.first_child, tree.next_sibling)),
        target_probs=probs.expand(NUM_SAMPLES, n, V),
        coins=torch.rand(NUM_SAMPLES, n, generator=gen),
        final_coins=torch.rand(NUM_SAMPLES, generator=gen),
    )


def first_two(tree: DraftTree, result: VerifyResult) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the first two emitted tokens (t2 = NONE if the step emitted only one)."""
    path = tree.tokens[result.accepted_nodes.clamp(min=0)]  # (rows, N) tokens along the path
    length, bonus = result.accept_length, result.bonus_tokens
    t1 = torch.where(length >= 2, path[:, min(1, tree.num_draft_tokens - 1)], bonus)
    t2 = torch.where(length >= 3, path[:, min(2, tree.num_draft_tokens - 1)], torch.where(length == 2, bonus, NONE))
    return t1, t2


def joint_tv(tree: DraftTree, probs: torch.Tensor, result: VerifyResult) -> tuple[float, float]:
    """(TV of the empirical (t1, t2) law from the exact one, the bound it must stay under)."""
    t1, t2 = first_two(tree, result)
    exact = exact_joint(tree, probs).flatten()
    return tv(empirical(t1 * (V + 1) + t2, exact.numel()), exact), tv_bound(exact, t1.numel())


def empirical(cells: torch.Tensor, num_cells: int) -> torch.Tensor:
    return torch.bincount(cells, minlength=num_cells).double() / cells.numel()


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def tv_bound(exact: torch.Tensor, n: int, delta: float = 1e-9) -> float:
    """A bound that the TV distance between `exact` and the empirical law of n samples from it
    exceeds with probability at most delta.

    Mean: E|p̂_k - p_k| <= sqrt(Var p̂_k) = sqrt(p_k (1 - p_k) / n) (Jensen), so
    E[TV] <= 1/2 * sum_k sqrt(p_k (1 - p_k) / n) <= 1/2 * sqrt(K / n) for K cells of mass > 0.
    Spread: changing one sample moves the TV by at most 1/n, so McDiarmid gives
    P(TV >= E[TV] + t) <= exp(-2 n t^2), and t = sqrt(ln(1 / delta) / (2 n)) makes that delta.
    (For n = 200k and ~40 cells this is ~0.017, tighter than the rule of thumb 4 * sqrt(K / n).)
    """
    p = exact.flatten()
    return 0.5 * float((p * (1 - p) / n).sqrt().sum()) + math.sqrt(math.log(1 / delta) / (2 * n))


@pytest.mark.parametrize("name", list(TREES))
def test_first_token_follows_target(name: str) -> None:
    tree = TREES[name]
    probs = node_probs(tree, seed=1)
    t1, _ = first_two(tree, verify_sample_reference(*draw(tree, probs, seed=2)))
    exact = probs[0].double()
    assert tv(empirical(t1, V), exact) <= tv_bound(exact, NUM_SAMPLES)


@pytest.mark.parametrize("name", list(TREES))
def test_first_two_tokens_follow_target(name: str) -> None:
    tree = TREES[name]
    probs = node_probs(tree, seed=3)
    distance, bound = joint_tv(tree, probs, verify_sample_reference(*draw(tree, probs, seed=4)))
    assert distance <= bound


@pytest.mark.parametrize("name", ["chain", "branching"])
def test_second_token_after_an_accepted_child_follows_its_node(name: str) -> None:
    tree = TREES[name]
    probs = node_probs(tree, seed=5)
    result = verify_sample_reference(*draw(tree, probs, seed=6))
    t1, t2 = first_two(tree, result)
    for c in root_children(tree):
        accepted_c = result.accepted_nodes[:, 1] == c
        assert (t1[accepted_c] == tree.tokens[c]).all()
        exact = probs[c].double()
        n = int(accepted_c.sum())
        assert n > 5_000  # enough for the bound to mean something
        assert tv(empirical(t2[accepted_c], V), exact) <= tv_bound(exact, n)


def over_accept(tree: DraftTree, inputs: SamplerInputs) -> VerifyResult:
    """Lossy: accept a child when u < 1.5 * acc (a coin on the wrong scale)."""
    return verify_sample_reference(*inputs._replace(coins=inputs.coins / 1.5))


def reuse_coin(tree: DraftTree, inputs: SamplerInputs) -> VerifyResult:
    """Lossy: sample the bonus with the level-0 coin instead of a fresh one. After a rejection at
    the root that coin is known to be >= the children's mass, so low tokens are never drawn."""
    return verify_sample_reference(*inputs._replace(final_coins=inputs.coins[:, 0]))


def keep_rejected(tree: DraftTree, inputs: SamplerInputs) -> VerifyResult:
    """Lossy: after rejecting cur's children, sample the bonus from all of q[cur], rejected
    children's tokens included (they are emitted too often)."""
    result = verify_sample_reference(*inputs)
    rows = torch.arange(NUM_SAMPLES)
    cur = result.accepted_nodes[rows, result.accept_length - 1]
    one_node = torch.full((NUM_SAMPLES, 1), -1)
    from_all = verify_sample_reference(
        torch.zeros(NUM_SAMPLES, 1, dtype=torch.int64),  # root-only trees, so nothing is zeroed
        one_node,
        one_node,
        inputs.target_probs[rows, cur][:, None],
        torch.zeros(NUM_SAMPLES, 1),
        inputs.final_coins,
    ).bonus_tokens
    had_children = tree.first_child[cur] >= 0
    return dataclasses.replace(result, bonus_tokens=torch.where(had_children, from_all, result.bonus_tokens))


@pytest.mark.parametrize("lossy", [over_accept, reuse_coin, keep_rejected])
@pytest.mark.parametrize("name", ["chain", "branching"])
def test_lossy_variants_fail_the_same_bound(name: str, lossy) -> None:
    tree = TREES[name]
    probs = node_probs(tree, seed=3)
    distance, bound = joint_tv(tree, probs, lossy(tree, draw(tree, probs, seed=4)))
    assert distance > bound, f"{lossy.__name__}: TV {distance:.4f} vs bound {bound:.4f}"


def test_under_a_grammar_the_tokens_follow_the_masked_target() -> None:
    """Structured outputs: the grammar's masks (as the verifier applies them) forbid a drafted root
    child's token and tokens below; the emitted pair follows the masked target exactly, and no
    forbidden token is ever emitted."""
    from specserve.config import SamplingParams
    from specserve.engine.sampling import apply_grammar, forbidden_tokens, target_probs

    tree = TREES["branching"]  # root children: tokens 3, 7, 1
    n = tree.num_draft_tokens
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(7))
    child = tree.parents >= 0
    logits[tree.parents[child], tree.tokens[child]] += 2.0
    allowed = torch.ones(n, V, dtype=torch.bool)
    allowed[0, [7, 5]] = False  # the root forbids the drafted child 7 and token 5
    allowed[1:, :4] = False  # below the root tokens 0-3 are forbidden: the drafted grandchild 2 among them
    bitmask = (allowed.int() << torch.arange(V)).sum(-1, keepdim=True).int()  # (N, 1): V < 32 bits
    apply_grammar(logits, forbidden_tokens(bitmask, V))
    probs = target_probs(logits, SamplingParams(temperature=1.0))
    assert float(probs[~allowed].sum()) == 0.0
    result = verify_sample_reference(*draw(tree, probs, seed=8))
    distance, bound = joint_tv(tree, probs, result)
    assert distance <= bound
    t1, t2 = first_two(tree, result)
    assert not torch.isin(t1, torch.tensor([5, 7])).any()
    assert not torch.isin(t2, torch.tensor([0, 1, 2, 3])).any()
