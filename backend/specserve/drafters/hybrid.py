"""A hybrid drafter: a draft head and suffix decoding in one engine, the proposal chosen per request
and step by expected accepted tokens per measured step cost (as Arctic Inference's hybrid picks
between its speculator and suffix decoding).

Every drafting step, suffix decoding proposes first (no model: a lookup), its trees sized against
the measured step cost as suffix decoding alone sizes them (`SuffixDrafter.propose_sized`), and
scores each tree with the tokens it expects accepted, scaled by how its scores have turned out so far
(`SuffixDrafter.gain`, over the rows it drafted). The head is expected to win its own measured mean
of accepted tokens per row, with the tree shape the engine's chooser picked. Two plans are weighed,
in tokens per second of the step:

    suffix alone:  sum(1 + s_i) / T                   T: the step's forward and verify (measured)
    with the head: sum(1 + max(s_i, h)) / (T + H)     H: the head's draft (measured), h: its mean

and with the head, each row takes whichever tree expects more. A step where suffix decoding wins
for every row runs no head forward at all; the head catches up on the skipped tokens when it next
drafts (it keeps the target's features of every accepted token meanwhile).

The two drafters come from the method's `combines` (`methods.Method`), head first; this module
names neither. It does not verify, and sizes no tree itself: the head's is the engine's chooser's,
suffix decoding's its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from specserve.config import SpecConfig
from specserve.drafters.base import DraftContext, Drafter, SequenceView
from specserve.drafters.suffix import HORIZON, SuffixDrafter
from specserve.estimates import RunningAverage
from specserve.models.llama import ForwardOutput
from specserve.runtime.cuda_graph import DraftGraphs
from specserve.runtime.prefill import PackedPrompts
from specserve.tree import DraftShape, DraftTree


class HybridDrafter(Drafter):
    nested_trees = True  # each row's tree is one drafter's, and both rank their nodes
    catches_up = True  # the head catches up on what it skipped

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
        self.aux_layers = head.aux_layers
        self.head_accepted = RunningAverage(HORIZON)  # accepted drafts per row the head drafted
        self.head_accepted.seed(1.0, 1)
        # plain means, not medians: a head that skipped steps catches up on them when it next drafts, and
        # that rarer, longer draft is part of what it costs
        self.head_seconds = RunningAverage(HORIZON)  # the head's draft (catch-up included), per step it ran
        self.rest_seconds = RunningAverage(HORIZON)  # the step after the draft, to on_accept
        self._head_rows: set[str] = set()  # the request ids whose tree this step is the head's
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

    @property
    def step_cost(self) -> Callable[[int, int], list[float | None]] | None:  # type: ignore[override]
        """The engine's step costs (`Drafter.step_cost`) size suffix decoding's trees."""
        return self.suffix.step_cost

    @step_cost.setter
    def step_cost(self, costs: Callable[[int, int], list[float | None]] | None) -> None:
        self.suffix.step_cost = costs

    def plan(self, scores: Sequence[float]) -> list[bool]:
        """Per row, whether the head drafts it (all False: no head forward this step)."""
        h = self.head_accepted.value
        use_head = [bool(h > s) for s in scores]
        if not any(use_head) or not self.rest_seconds.samples or not self.head_seconds.samples:
            return use_head  # costs not measured yet: the better expectation per row
        rest, head = self.rest_seconds.value, self.head_seconds.value
        alone = sum(1 + s for s in scores) / rest
        with_head = sum(1 + max(s, h) for s in scores) / (rest + head)
        return use_head if with_head > alone else [False] * len(scores)

    def propose(self, seqs: Sequence[SequenceView], shape: DraftShape | None = None) -> list[DraftTree]:
        shape = shape or self.suffix.draft_plan.shape
        trees, scores = self.suffix.propose_sized(seqs, shape)
        gain = self.suffix.gain()
        use_head = self.plan([score * gain for score in scores])
        rows = [i for i, u in enumerate(use_head) if u]
        if rows:
            start = time.perf_counter()
            proposal = self.head.propose([seqs[i] for i in rows], shape)
            head_trees = proposal if isinstance(proposal, list) else proposal.unbatch()
            self.head_seconds.add(time.perf_counter() - start)
            for i, tree in zip(rows, head_trees):
                trees[i] = tree
                self.suffix.withdraw(seqs[i].request_id)
                self._head_rows.add(seqs[i].request_id)
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
        head_rows, self._head_rows = self._head_rows, set()
        for s, nodes in zip(seqs, accepted):
            if s.request_id in head_rows:  # suffix decoding's rows calibrate it in its own on_accept
                self.head_accepted.add(len(nodes) - 1)
        self.head.on_accept(seqs, out, accepted)
        self.suffix.on_accept(seqs, out, accepted)

    def on_prefill(self, seqs: Sequence[SequenceView], out: ForwardOutput, packed: PackedPrompts) -> None:
        self.head.on_prefill(seqs, out, packed)
        self.suffix.on_prefill(seqs, out, packed)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.head.copy_prefix(src, dst, n)
        self.suffix.copy_prefix(src, dst, n)

    def release(self, request_id: str) -> None:
        self._head_rows.discard(request_id)
        self.head.release(request_id)
        self.suffix.release(request_id)

    def forget(self) -> None:
        self.head.forget()
        self.suffix.forget()
