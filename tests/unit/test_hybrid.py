"""The hybrid drafter's choice between a head and suffix decoding (`drafters.hybrid`), with a fake head."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specserve.config import SpecConfig
from specserve.draft_plan import DraftPlan
from specserve.drafters.base import Drafter
from specserve.drafters.hybrid import HybridDrafter
from specserve.drafters.suffix import GAIN_PRIOR_ROWS, HORIZON, SuffixDrafter
from specserve.methods import METHODS
from specserve.tree import DraftTree


@dataclass
class Seq:
    request_id: str
    token_ids: list[int]
    cache_salt: str | None = None
    slot: int = 0
    cache_len: int = 0


class FakeHead(Drafter):
    """Proposes the chain root, 99, 98; records who it drafted for and what it was told."""

    def __init__(self) -> None:
        self.drafted: list[str] = []
        self.accepted_calls = 0

    def propose(self, seqs, shape=None):
        self.drafted += [s.request_id for s in seqs]
        return [DraftTree.from_parents([s.token_ids[-1], 99, 98], [-1, 0, 1]) for s in seqs]

    def on_accept(self, seqs, out, accepted):
        self.accepted_calls += 1


def hybrid() -> tuple[HybridDrafter, FakeHead]:
    head = FakeHead()
    return HybridDrafter(head, SuffixDrafter(DraftPlan.of(SpecConfig(algorithm="suffix")))), head


def accept(d: HybridDrafter, seqs: list[Seq], lengths: list[int]) -> None:
    d.on_accept(seqs, None, [torch.arange(n) for n in lengths])


def test_the_row_with_a_suffix_match_takes_suffix_the_other_the_head():
    d, head = hybrid()
    known = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    d.suffix.on_accept([Seq("old", known)], None, None)
    d.suffix.release("old")
    seqs = [Seq("a", [50, 3, 4, 5, 6]), Seq("b", [60, 61, 62])]
    trees = d.propose(seqs)
    assert trees[0].tokens.tolist() == [6, 7, 8, 9, 10]  # suffix: [3 4 5 6] matched, 4 deep, score 4 > 1
    assert trees[1].tokens.tolist() == [62, 99, 98] and head.drafted == ["b"]
    accept(d, seqs, [5, 1])
    assert head.accepted_calls == 1  # the head keeps every accepted token's features, whoever drafted
    assert d.mix() == {"head": 1, "suffix": 1}
    assert d.suffix_accepted.value == 4 and d.head_accepted.value == 0


@pytest.mark.parametrize(("per_node", "size"), [(0.0, 5), (1.0, 1)])
def test_suffix_rows_are_sized_by_the_step_cost_as_suffix_decoding_alone_sizes_them(per_node, size):
    """With the engine's step costs, a suffix row's tree is the size that pays (`SuffixDrafter.tree_size`),
    not the chooser's shape: free nodes take the whole match, nodes that each cost a step take none."""
    d, head = hybrid()
    d.step_cost = lambda batch_size, n: [0.01 * (1 + per_node * i) for i in range(n)]
    d.suffix.on_accept([Seq("old", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])], None, None)
    d.suffix.release("old")
    d.rest_seconds.add(0.01)
    d.head_seconds.add(1.0)  # a head that never pays
    tree = d.propose([Seq("a", [50, 3, 4, 5, 6])], DraftPlan.of(SpecConfig(algorithm="hybrid")).menu[1])[0]
    assert tree.tokens.tolist() == [6, 7, 8, 9, 10][:size] and head.drafted == []


def test_the_head_is_weighed_at_the_step_cost_of_the_trees_it_adds():
    """A row suffix decoding cannot draft: the head's tree is worth its draft where the step's cost
    with it stays near the root-only step's, not where its nodes cost a step each (the measured mean
    of past steps, with suffix decoding's large trees in it, hid that)."""
    d, _ = hybrid()
    d.head_seconds.add(0.002)
    d.head_accepted.add(1.0)  # with the seed, about 1 accepted a row
    assert d.plan([0.0], (0.010, 0.011)) == [True]  # 2 / 13 ms beats 1 / 10 ms
    assert d.plan([0.0], (0.010, 0.020)) == [False]  # 2 / 22 ms does not


def test_no_head_forward_when_the_measured_costs_say_suffix_alone_is_faster():
    d, _ = hybrid()
    for _ in range(3):
        d.rest_seconds.add(0.010)
        d.head_seconds.add(0.010)  # the head doubles the step
    d.head_accepted.add(1.5)  # its mean, about 1.5
    # suffix expects 0.5 and 3: alone (1.5 + 4) / 10 ms beats (2.5 + 4) / 20 ms with the head
    assert d.plan([0.5, 3.0]) == [False, False]
    # a cheap head: (2.5 + 4) / 11 ms beats 5.5 / 10 ms, and the first row takes it
    for _ in range(200):
        d.head_seconds.add(0.001)
    assert d.plan([0.5, 3.0]) == [True, False]


def test_the_head_drafts_one_row_until_its_cost_is_measured():
    """The head's first draft catches up on each of its rows' whole text: one row measures what it costs
    before the head is weighed for a whole batch."""
    d, head = hybrid()
    seqs = [Seq(f"r{i}", [60 + i, 61, 62]) for i in range(4)]
    trees = d.propose(seqs)
    assert head.drafted == ["r0"] and [t.num_draft_tokens for t in trees] == [3, 1, 1, 1]
    accept(d, seqs, [3, 1, 1, 1])  # both its drafts accepted
    assert d.head_seconds.samples == 1
    d.rest_seconds.add(0.01)
    d.head_seconds.reset()
    d.head_seconds.add(0.0001)  # measured cheap: every row that expects more from it takes it
    assert d.plan([0.0] * 4) == [True] * 4


def test_a_step_where_neither_drafter_pays_is_declined():
    d, head = hybrid()
    d.step_cost = lambda batch_size, n: [0.01 * (1 + i) for i in range(n)]  # every node costs a step
    d.rest_seconds.add(0.01)
    d.head_seconds.add(1.0)  # a head that never pays
    assert d.propose([Seq("a", [60, 61, 62])])[0].num_draft_tokens == 1 and head.drafted == []
    assert d.declined  # the head was expected to win a token, at a cost that did not pay
    d.head_seconds.reset()
    d.head_seconds.add(0.0001)  # a head that costs nothing drafts the row
    d.step_cost = lambda batch_size, n: [0.01] * n
    assert d.propose([Seq("a", [60, 61, 62])])[0].num_draft_tokens == 3 and not d.declined


def test_suffix_scores_are_scaled_by_how_they_turned_out():
    d, _ = hybrid()
    assert d.suffix_gain() == 1.0
    for _ in range(HORIZON):
        d.suffix_accepted.add(1.0)
        d.suffix_scored.add(4.0)
    assert d.suffix_gain() == pytest.approx((HORIZON + GAIN_PRIOR_ROWS) / (4 * HORIZON + GAIN_PRIOR_ROWS))


def test_one_unlucky_suffix_tree_does_not_keep_suffix_from_drafting_again():
    """Its first tree accepting nothing once scaled every later score to 0: suffix never drafted
    again, even on text it had served word for word."""
    d, _ = hybrid()
    d.head_accepted.add(0.6)
    d.suffix_accepted.add(0.0)
    d.suffix_scored.add(1.5)
    assert 0.8 < d.suffix_gain() < 1.0
    for _ in range(HORIZON):  # a long run of failed short matches
        d.suffix_accepted.add(0.0)
        d.suffix_scored.add(1.0)
    assert d.plan([0.5 * d.suffix_gain(), 20.0 * d.suffix_gain()]) == [True, False]  # a long match drafts


def test_the_method_row_names_the_drafters_it_combines():
    m = METHODS["hybrid"]
    assert m.combines == ("eagle3", "suffix") and m.runs_head and not m.is_head
    assert dict(m.served)["drafter_path"].endswith("llm_eagle3/drafter")


def test_a_successor_hybrid_takes_the_suffix_store_over():
    old, _ = hybrid()
    old.suffix.on_accept([Seq("a", [1, 2, 3, 4, 5, 6])], None, None)
    old.release("a")
    new, _ = hybrid()
    new.inherit(old)
    assert new.suffix.shared is old.suffix.shared and (new.cached_tokens, old.cached_tokens) == (7, 0)
