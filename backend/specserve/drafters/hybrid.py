"""A hybrid drafter: a draft head and suffix decoding in one engine, the proposal chosen per request
and step by expected accepted tokens per measured step cost (as Arctic Inference's hybrid picks
between its speculator and suffix decoding).

Every drafting step, suffix decoding proposes first (no model: a lookup) and scores each tree with
the tokens it expects accepted, scaled by how its scores have turned out so far (accepted / scored,
over the rows it drafted). The head is expected to win its own measured mean of accepted tokens per
row. Two plans are weighed, in tokens per second of the step:

    suffix alone:  sum(1 + s_i) / T                   T, T': the step's forward and verify with suffix
    with the head: sum(1 + max(s_i, h)) / (T' + H)    decoding's trees, and with the head's beside them
                                                      (the engine's step cost at their sizes, else the
                                                      measured mean); H: the head's draft (measured),
                                                      h: its mean

and with the head, each row takes whichever tree expects more. A step where suffix decoding wins
for every row runs no head forward at all; the head catches up on the skipped tokens when it next
drafts (it keeps the target's features of every accepted token meanwhile).

The two drafters come from the method's `combines` (`methods.Method`), head first; this module
names neither. It does not verify, and it does not choose the tree size (the engine's chooser does).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from specserve.config import SpecConfig
from specserve.drafters.base import DraftContext, Drafter, SequenceView
from specserve.drafters.suffix import HORIZON, SuffixDrafter, calibrated_gain
from specserve.estimates import RunningAverage
from specserve.models.llama import ForwardOutput
from specserve.runtime.cuda_graph import DraftGraphs
from specserve.runtime.prefill import PackedPrompts
from specserve.tree import DraftShape, DraftTree


class HybridDrafter(Drafter):
    nested_trees = True  # each row's tree is one drafter's, and both rank their nodes
    # the head catches up on what it skipped, but only on the rows `plan` gives it, whose cost `plan` weighs
    # (`head_seconds` counts its catch-ups): the chooser explores as it does for suffix decoding alone
    catches_up = False

    @classmethod
    def build(cls, spec: SpecConfig, ctx: DraftContext) -> Drafter:
        from specserve.drafters.factory import build_drafter

        head_name, suffix_name = spec.method.combines
        head = build_drafter(replace(spec, algorithm=head_name), ctx)
        suffix = build_drafter(replace(spec, algorithm=suffix_name), ctx)
        assert isinstance(suffix, SuffixDrafter)
        return cls(head, suffix)

    def __init__(self, head: Drafter, suffix: SuffixDrafter) -> None:
        self.head, self.suffix = head, suffix
        # the head catches up on a prompt at its first draft of the request, not at prefill: on chat at
        # batch 8 suffix decoding or plain steps take nearly every row, and the catch-up cost 6-8 % of prefill
        head.catch_up_on_prefill = False
        self.aux_layers = head.aux_layers
        self.head_accepted = RunningAverage(HORIZON)  # accepted drafts per row the head drafted
        self.head_accepted.seed(1.0, 1)
        self.suffix_accepted = RunningAverage(HORIZON)  # accepted drafts per row suffix drafted ...
        self.suffix_scored = RunningAverage(HORIZON)  # ... and what their scores expected
        # plain means, not medians: a head that skipped steps catches up on them when it next drafts, and
        # that rarer, longer draft is part of what it costs
        self.head_seconds = RunningAverage(HORIZON)  # the head's draft (catch-up included), per step it ran
        self.rest_seconds = RunningAverage(HORIZON)  # the step after the draft, to on_accept
        self._by_head: dict[str, bool] = {}  # request id -> whether its last tree was the head's
        self._scores: dict[str, float] = {}
        self._proposed_at: float | None = None
        self.head_rows = self.suffix_rows = 0  # rows each drafted so far (the bench reports the mix)

    # the profile's draft-model figures are the head's
    @property
    def num_forwards(self) -> int:  # type: ignore[override]
        return self.head.num_forwards

    @property
    def forward_seconds(self) -> float:  # type: ignore[override]
        return self.head.forward_seconds

    @property
    def cached_tokens(self) -> int:
        return self.suffix.cached_tokens

    def mix(self) -> dict[str, int]:
        return {"head": self.head_rows, "suffix": self.suffix_rows}

    def suffix_gain(self) -> float:
        """Accepted tokens per unit of suffix score over the rows suffix decoding drafted here
        (`calibrated_gain`)."""
        return calibrated_gain(self.suffix_accepted, self.suffix_scored)

    def plan(self, scores: Sequence[float], step_seconds: tuple[float, float] | None = None) -> list[bool]:
        """Per row, whether the head drafts it (all False: no head forward this step). step_seconds: the
        step's expected seconds after the draft with suffix decoding's trees alone and with the head's too
        (the engine's `step_cost` at their sizes); None: the measured mean of either. Until the head's cost
        is measured, only the first row that expects more from it takes it."""
        h = self.head_accepted.value
        use_head = [bool(h > s) for s in scores]
        if step_seconds is None and self.rest_seconds.samples:
            step_seconds = (self.rest_seconds.value, self.rest_seconds.value)
        if any(use_head) and not self.head_seconds.samples:
            # the head's cost unmeasured: one row measures it (its first draft catches up on each row's whole
            # text, and at batch 8 on chat that cost two dozen plain steps for about one token a row)
            first = use_head.index(True)
            return [i == first for i in range(len(use_head))]
        if not any(use_head) or step_seconds is None:
            return use_head  # costs not measured yet: the better expectation per row
        (rest, rest_with_head), head = step_seconds, self.head_seconds.value
        alone = sum(1 + s for s in scores) / rest
        with_head = sum(1 + max(s, h) for s in scores) / (rest_with_head + head)
        return use_head if with_head > alone else [False] * len(scores)

    def suffix_trees(self, seqs: Sequence[SequenceView], shape: DraftShape
                     ) -> tuple[list[tuple[DraftTree, float]], tuple[float, float] | None]:
        """Suffix decoding's tree and score per row, and the step's expected seconds after the draft with
        those trees alone and with the head's shape beside them (`plan`'s step_seconds). Sized by those
        seconds where the engine has them, as suffix decoding alone sizes its trees (`SuffixDrafter.tree_size`,
        with the gain its rows earned here); else by the chooser's shape, seconds None."""
        largest = self.suffix.draft_plan.shape.num_draft_tokens
        costs = self.step_cost(len(seqs), largest) if self.step_cost is not None else [None] * largest
        if all(c is None for c in costs):
            self.suffix.declined = False
            return [self.suffix.propose_scored(s, shape.num_draft_tokens) for s in seqs], None
        trees, scores, size = self.suffix.sized_trees(seqs, costs, self.suffix_gain())
        alone, with_head = costs[size - 1], costs[min(max(size, shape.num_draft_tokens), largest) - 1]
        seconds = None if alone is None or with_head is None else (alone, with_head)
        return list(zip(trees, scores)), seconds

    def propose(self, seqs: Sequence[SequenceView], shape: DraftShape | None = None) -> list[DraftTree]:
        shape = shape or self.suffix.draft_plan.shape
        scored, step_seconds = self.suffix_trees(seqs, shape)
        gain = self.suffix_gain()
        expected = [score * gain for _, score in scored]
        use_head = self.plan(expected, step_seconds)
        trees = [tree for tree, _ in scored]
        rows = [i for i, u in enumerate(use_head) if u]
        # nothing drafted, though suffix decoding's trees or the head (expected to win more) were there
        self.declined = not rows and all(t.num_draft_tokens == 1 for t in trees) and (
            self.suffix.declined or any(self.head_accepted.value > s for s in expected))
        if rows:
            start = time.perf_counter()
            proposal = self.head.propose([seqs[i] for i in rows], shape)
            head_trees = proposal if isinstance(proposal, list) else proposal.unbatch()
            self.head_seconds.add(time.perf_counter() - start)
            for i, tree in zip(rows, head_trees):
                trees[i] = tree
        for s, (_, score), u in zip(seqs, scored, use_head):
            self._by_head[s.request_id], self._scores[s.request_id] = u, score
        self.head_rows += len(rows)
        self.suffix_rows += len(seqs) - len(rows)
        self._proposed_at = time.perf_counter()
        return trees

    @property
    def graphs(self) -> DraftGraphs | None:
        return self.head.graphs

    def on_accept(self, seqs: Sequence[SequenceView], out: ForwardOutput, accepted: Sequence[torch.Tensor]) -> None:
        if self._proposed_at is not None:
            self.rest_seconds.add(time.perf_counter() - self._proposed_at)
            self._proposed_at = None
        for s, nodes in zip(seqs, accepted):
            by_head = self._by_head.pop(s.request_id, None)  # None: no tree this step
            score = self._scores.pop(s.request_id, 0.0)
            if by_head is None:
                continue
            if by_head:
                self.head_accepted.add(len(nodes) - 1)
            else:
                self.suffix_accepted.add(len(nodes) - 1)
                self.suffix_scored.add(score)
        self.head.on_accept(seqs, out, accepted)
        self.suffix.on_accept(seqs, out, accepted)

    def on_prefill(self, seqs: Sequence[SequenceView], out: ForwardOutput, packed: PackedPrompts) -> None:
        self.head.on_prefill(seqs, out, packed)
        self.suffix.on_prefill(seqs, out, packed)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.head.copy_prefix(src, dst, n)
        self.suffix.copy_prefix(src, dst, n)

    def release(self, request_id: str) -> None:
        self._by_head.pop(request_id, None)
        self._scores.pop(request_id, None)
        self.head.release(request_id)
        self.suffix.release(request_id)

    def forget(self) -> None:
        self.head.forget()
        self.suffix.forget()

    def inherit(self, previous: Drafter) -> None:
        if isinstance(previous, HybridDrafter):
            self.head.inherit(previous.head)
            self.suffix.inherit(previous.suffix)
