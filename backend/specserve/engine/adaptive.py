"""Cost-aware speculation: every step, the draft shape that maximises expected tokens per second.

A shape is the drafter's tree of `num_draft_tokens` n verified (root included),
grown for min(num_steps, n - 1) draft steps at the configured topk (EAGLE-2's dynamic tree keeps
the n - 1 likeliest nodes). n = 1 is plain decoding: no draft forward at all, and model-based
drafters defer their catch-up until they draft again. The menu is n = 1, 2, 3, 4, 6, 8, 12, ...
up to the configured num_draft_tokens (`draft_plan.shape_menu`).

`ShapeChooser` keeps, per batch-size bucket and shape, an estimate of the step's wall time and,
per shape, the mean accept length, and runs the shape with the largest accept_length / step_time
(a drafting shape must beat plain decoding by `margin`); it explores the shapes around the best
one every `explore_every` steps. Its class docstring has the rules.

This module measures nothing itself and knows nothing about models or trees: the engine reports
each step's batch size, shape, time and accept lengths (`observe`), and each forward's path and time.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence

from specserve.estimates import RunningAverage
from specserve.tree import DraftShape


class ShapeChooser:
    """Per step: `choose(batch_size)` -> a shape of the menu; after it: `observe(...)`.

    `ShapeChooser` keeps, per batch-size bucket and shape, an estimate of the step's wall time
    (measured at warm-up, then on every step: the median of the first samples, then a moving average
    that one slow step moves by a tenth at most) and, per shape, the mean accept length (tokens a
    request gains per step, the bonus token included; each request of a step is one sample). Where the
    drafter's trees are nested (EAGLE's dynamic tree: a smaller tree keeps a prefix of a larger
    one's nodes), a step that drafts n tokens also measures the acceptance of every smaller tree.
    A step runs the shape with the largest accept_length / step_time for its bucket, where a drafting
    shape must beat plain decoding by `margin` (step times on a busy CPU are noisy: a near-tie is not
    worth a draft). A shape's time, and a drafting shape's acceptance, count as unmeasured until
    `min_samples` samples have come in (a warm-up timing counts as that many): one slow or unlucky
    step must not lock a shape out. A drafting shape of unmeasured acceptance runs only if an
    optimistic bound on its acceptance (from the smaller shapes measured) could beat the best shape:
    at batch 4 on a small CPU a draft step costs 1.3-4x a plain one, and measuring every shape's
    acceptance there cost more than drafting ever won. Every `explore_every`-th step runs another
    shape instead, so the estimates around the best one stay current: its neighbours on the menu and
    the runner-up, in turn, and plain decoding whenever a draft is best (while plain decoding is
    best, every 4 x `explore_every` steps for a drafter with a model to run, every `explore_every`
    for one that drafts from the tokens alone, whose draft costs only the rows it adds to a
    verification; a drafter that catches up on skipped tokens then drafts for two steps, and only
    the second one's time stands for the shape; other shapes estimated below `explore_within` of
    the best are not tried). An explored draft that did not run (its step decoded plainly: the
    drafter found nothing to draft, or a grammar's forced text took the step) is tried again at the
    next step, so an exploration always measures the shape; not where a drafter that sizes its trees
    by the step's costs had drafts and found none worth it (at batch 8 on chat suffix decoding's
    matches rarely pay, and a retry at every step cost a lookup of every row each time). For a drafter
    that catches up, each exploration from plain decoding also pays a catch-up over every token skipped
    since the last one (about a hundredth of a step per token on a 2-core CPU), so while explorations
    keep leaving plain decoding best, the period doubles, up to `max_backoff` times; it is back to 4 x `explore_every`
    once a draft is best. The smallest drafting shape, when no step has sampled its acceptance for
    `stale_after` of plain decoding's longest exploration periods, is explored whatever its estimate: a
    few unlucky first samples (a grammar's text, a stretch of chat) must not keep a drafter idle for good.
    Warm-up timings ran on a synthetic prompt, perhaps while the machine was busy: they make a shape
    measured, but they are provisional. A shape's first real step time replaces its warm-up figure
    (it is never averaged with it), and a neighbour or runner-up whose time is still only its warm-up
    figure is explored whatever its estimate, before the other candidates, so a skewed warm-up step
    is corrected at the next explorations instead of locking the shape out; not for a drafter that
    catches up, whose exploration pays a catch-up over every skipped token of every row (at batch 8 as
    much as a dozen plain steps): its shapes are explored by their estimates, and the stale rule retries
    its smallest drafting shape.
    """

    def __init__(self, menu: Sequence[DraftShape], batch_buckets: Sequence[int], explore_every: int = 16,
                 margin: float = 0.05, explore_within: float = 0.8, min_samples: int = 3,
                 drafts_catch_up: bool = True, max_backoff: int = 4, stale_after: int = 8) -> None:
        """drafts_catch_up: the drafter's first draft after plain steps catches up on them (`Drafter.catches_up`)."""
        self.menu = tuple(menu)
        self.drafts_catch_up = drafts_catch_up
        self.buckets = sorted(set(batch_buckets))
        self.explore_every = explore_every
        self.margin = margin
        self.explore_within = explore_within
        self.min_samples = min_samples
        self.max_backoff = max_backoff
        self.stale_after = stale_after
        self._backoff = 1  # the plain-decoding exploration period's factor (see the module's docstring)
        # seconds
        self.step_time = {(b, s): RunningAverage(horizon=10, robust=True) for b in self.buckets for s in self.menu}
        self.accept = {s: RunningAverage(horizon=40) for s in self.menu}  # tokens per request per step
        self.chosen: Counter[DraftShape] = Counter()
        self._steps = 0
        self._step = 0  # steps chosen in all
        self._smallest = next((s for s in self.menu if s.drafts), None)  # the drafting shape that goes stale
        self._smallest_sampled_at = 0  # the step its acceptance was last sampled
        self._explored = 0
        self._again: DraftShape | None = None  # an explored draft's second step (see `choose`)
        self._exploring: DraftShape | None = None  # the draft this step explores, until it runs

    def bucket(self, batch_size: int) -> int:
        i = bisect.bisect_left(self.buckets, batch_size)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def timed(self, batch_size: int, shape: DraftShape) -> bool:
        """Whether the shape's step time at this batch size counts as measured by real steps, not only by
        its warm-up figure, which makes it explored whatever its estimate (a shape off the menu counts)."""
        t = self.step_time.get((self.bucket(batch_size), shape))
        return t is None or (t.count >= self.min_samples and not t.provisional)

    def rate(self, batch_size: int, shape: DraftShape) -> float | None:
        """Expected accept length per second of one request, or None while unmeasured."""
        t, a = self.step_time[(self.bucket(batch_size), shape)], self.accept[shape]
        if t.count < self.min_samples:
            return None
        if not shape.drafts:
            return 1.0 / t.value
        return a.value / t.value if a.count >= self.min_samples else None

    def acceptance_bound(self, shape: DraftShape) -> float | None:
        """An optimistic accept length for a drafting shape whose acceptance is not measured yet,
        from the largest smaller drafting shape that is: its accepted tokens per draft node, times
        this shape's draft nodes (a chain accepts its k-th token only after the ones before it, and a
        tree keeps its likeliest nodes first, so further nodes add no more than the average so far),
        and at most 1 + the draft's depth. None when no smaller drafting shape is measured."""
        smaller = [s for s in self.menu if s.drafts and s.num_draft_tokens < shape.num_draft_tokens
                   and self.accept[s].count >= self.min_samples]
        if not smaller:
            return None
        ref = smaller[-1]
        per_node = (self.accept[ref].value - 1.0) / (ref.num_draft_tokens - 1)
        return min(1.0 + per_node * (shape.num_draft_tokens - 1), 1.0 + shape.num_steps)

    def _worth_measuring(self, batch_size: int, shape: DraftShape, best_rate: float) -> bool:
        """Whether a drafting shape of unmeasured acceptance could beat `best_rate` (handicapped
        by the margin, as `best` would): the smallest such shape always could."""
        bound = self.acceptance_bound(shape)
        t = self.step_time[(self.bucket(batch_size), shape)].value
        return bound is None or bound / t / (1.0 + self.margin) >= best_rate

    def best(self, batch_size: int) -> DraftShape:
        """The measured shape with the highest rate. First, shapes whose time is unmeasured,
        smallest first; then drafting shapes whose acceptance is unmeasured, smallest first, if their
        `acceptance_bound` could beat the best measured rate (at a large batch, where a draft step
        costs far more than a plain one, most are never run)."""
        b = self.bucket(batch_size)
        untimed = [s for s in self.menu if self.step_time[(b, s)].count < self.min_samples]
        if untimed:
            return untimed[0]
        rates = [(self.rate(batch_size, s), s) for s in self.menu]
        handicap = [(r / (1.0 + self.margin) if s.drafts else r, s) for r, s in rates if r is not None]
        top_rate, top = max(handicap, key=lambda rs: (rs[0], -rs[1].num_draft_tokens))
        for r, s in rates:
            if r is None and self._worth_measuring(batch_size, s, top_rate):
                return s
        return top

    def stale(self, shape: DraftShape) -> bool:
        """Whether the smallest drafting shape's measured acceptance has gone unsampled for `stale_after`
        of plain decoding's longest exploration periods (`explore_every`, x 4 x `max_backoff` for a
        drafter that catches up: its exploration pays a catch-up); it is explored again whatever its
        estimate. Larger shapes are not: their bounds follow from it (`acceptance_bound`), and a drafter
        that sizes its own trees (suffix decoding) runs the same tree whichever drafting shape is explored."""
        period = self.explore_every * (4 * self.max_backoff if self.drafts_catch_up else 1)
        return (shape == self._smallest and self.accept[shape].count >= self.min_samples
                and self._step - self._smallest_sampled_at >= self.stale_after * period)

    def choose(self, batch_size: int) -> DraftShape:
        self._steps += 1
        self._step += 1
        again, self._again = self._again, None
        shape = again or self.best(batch_size)
        if again is None and shape.drafts:
            self._backoff = 1
        # plain decoding explores 4x less often where a draft it tries costs a draft model's forwards
        period = self.explore_every * (1 if shape.drafts or not self.drafts_catch_up else 4 * self._backoff)
        if self._steps >= period:
            self._steps = 0
            candidates = self._explore_candidates(batch_size, shape)
            self._explored += 1
            explored = self._to_explore(batch_size, candidates) or shape
            if explored.drafts and not shape.drafts and self.drafts_catch_up:
                # drafted twice: the first catches up on the plain steps, the second is timed
                self._again = explored
                self._backoff = min(2 * self._backoff, self.max_backoff)
            shape = again = explored
        self._exploring = shape if again is not None and shape.drafts else None  # an exploration or its retry
        self.chosen[shape] += 1
        return shape

    def _doubted(self, bucket: int, shape: DraftShape) -> bool:
        """Whether the shape's time is only its warm-up figure and worth an exploration whatever its estimate:
        plain decoding's always, a draft's where the drafter does not catch up (its exploration costs a step)."""
        return self.step_time[(bucket, shape)].provisional and not (shape.drafts and self.drafts_catch_up)

    def _to_explore(self, batch_size: int, candidates: Sequence[DraftShape]) -> DraftShape | None:
        """The candidate this exploration runs: the smallest whose time is still only its warm-up
        figure (a busy moment may have skewed it; plain decoding first, the baseline every draft
        must beat), else the next in turn."""
        b = self.bucket(batch_size)
        provisional = [s for s in candidates if self._doubted(b, s) or self.stale(s)]
        if provisional:
            return min(provisional, key=lambda s: s.num_draft_tokens)
        return candidates[self._explored % len(candidates)] if candidates else None

    def _explore_candidates(self, batch_size: int, best: DraftShape) -> list[DraftShape]:
        """The best shape's neighbours on the menu and the runner-up, if estimated within
        `explore_within` of the best (a shape of unmeasured acceptance by its `acceptance_bound`):
        at large batches a draft can cost twice a plain step, and its catch-up grows with the steps
        it skipped; whatever its estimate if its time is only a warm-up figure, which a busy moment
        may have skewed. Plain decoding, whatever its estimate, when a draft is best."""
        best_rate = self.rate(batch_size, best) or 0.0

        def estimate(s: DraftShape) -> float:
            rate = self.rate(batch_size, s)
            if rate is not None:
                return rate
            t, bound = self.step_time[(self.bucket(batch_size), s)], self.acceptance_bound(s)
            return bound / t.value if bound is not None and t.count else best_rate

        i = self.menu.index(best)
        others = [(estimate(s), s) for s in self.menu if s != best]
        runner_up = max(others, key=lambda rs: rs[0])[1] if others else None
        picks = [self.menu[j] for j in (i - 1, i + 1) if 0 <= j < len(self.menu)]
        if runner_up is not None and runner_up not in picks:
            picks.append(runner_up)
        b = self.bucket(batch_size)
        picks = [s for s in picks if estimate(s) >= self.explore_within * best_rate
                 or self._doubted(b, s) or self.stale(s)]
        plain = self.menu[0]
        if best.drafts and not plain.drafts and plain not in picks:
            # the baseline every draft must beat: a stale estimate of it (a slow warm-up step)
            # would keep a losing draft running, and one plain step costs a drafter one token
            picks.append(plain)
        return picks

    def observe(self, batch_size: int, shape: DraftShape, seconds: float | None, accept_lengths: Sequence[int],
                accepted_nodes: Sequence[Sequence[int]] | None = None, warm_up: bool = False,
                declined: bool = False) -> None:
        """One step's wall time and per-request accept lengths; shapes off the menu are ignored.
        Each request's accept length is a sample of the shape's acceptance (a step at batch 4
        measures it four times); warm_up: a start-up timing, which seeds the estimate until the
        shape's first real step time replaces it (`RunningAverage.seed`).
        seconds None: a step whose time does not stand for the shape's (its forward explored a slower
        path, see `PathChooser.settled_on`, or it drafted after plain steps, so its drafter caught
        up on the tokens it had skipped, a new request's whole prompt included); its acceptance
        still counts.

        accepted_nodes: per request, the accepted node indices (root first), given when the
        drafter's trees are nested (a smaller tree is a prefix of this one): a request would
        then have accepted, with num_draft_tokens n, the root and its accepted nodes below n, so every
        smaller drafting shape's acceptance is measured on this step too.

        declined: the step decoded plainly because its drafter, which sizes its own trees by the step's
        costs, had drafts and found none worth its cost (`Drafter.declined`): the explored draft is
        answered for now, not tried again at the next step."""
        exploring, self._exploring = self._exploring, None
        if exploring is not None and not shape.drafts and not warm_up and not declined:  # the draft did not run
            self._again = exploring
        if shape not in self.accept:
            return
        if seconds is not None:
            t = self.step_time[(self.bucket(batch_size), shape)]
            if warm_up:
                t.seed(seconds, self.min_samples)
            else:
                t.add(seconds)
        if not shape.drafts or not accept_lengths:
            return
        self.accept[shape].add(sum(accept_lengths) / len(accept_lengths), len(accept_lengths))
        if shape == self._smallest or accepted_nodes:  # nested trees measure the smallest shape too
            self._smallest_sampled_at = self._step
        if accepted_nodes:
            for smaller in self.menu:
                if smaller.drafts and smaller.num_draft_tokens < shape.num_draft_tokens:
                    n = smaller.num_draft_tokens
                    lengths = [1 + sum(j < n for j in nodes[1:]) for nodes in accepted_nodes]
                    self.accept[smaller].add(sum(lengths) / len(lengths), len(lengths))

    def forget_acceptance(self) -> None:
        """After warm-up on a synthetic prompt: its accept lengths say nothing about real text
        (a repetitive prompt flatters NGRAM), so each drafting shape is measured afresh."""
        for a in self.accept.values():
            a.reset()
        self.chosen.clear()

    def summary(self) -> dict:
        """What the bench JSON reports: how often each shape ran, and the current estimates."""
        return {
            "chosen": {str(s): n for s, n in sorted(self.chosen.items())},
            "accept_length": {str(s): round(a.value, 3) for s, a in self.accept.items() if a.count},
            "step_ms": {f"bs{b}:{s}": round(t.value * 1e3, 2) for (b, s), t in self.step_time.items() if t.count},
        }
