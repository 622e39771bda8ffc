"""Which path the target's forward takes on a CPU: the compiled step program or eager PyTorch.

Neither is faster on every CPU, and on some the program's speed differs from one process to the
next, so a timing taken at start-up only seeds the choice: each (batch-size bucket, tokens per
request) key runs its faster measured path and, every `explore_every`-th step, the other, so a
path that turns slow is left within a few dozen steps. A path measured more than
`explore_within` times slower is tried that much less often, so exploring costs about
1/`explore_every` of a step whatever the gap.

`RunningAverage` is the estimate both this chooser and the draft-shape chooser keep. This module
measures nothing itself: the runtime reports each forward's path and time.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter


class RunningAverage:
    """A running mean over the first `horizon` samples, then an exponential moving average.

    robust (for times, whose noise is one-sided: a step is never faster than its work, often
    slower): the median of the first `horizon` samples, then a moving average of samples clipped
    to twice the estimate. A sample of weight w counts as w equal samples."""

    def __init__(self, horizon: int, robust: bool = False) -> None:
        self.horizon, self.robust, self.count, self.value = horizon, robust, 0, 0.0
        self._first: list[float] = []

    def add(self, x: float, weight: int = 1) -> None:
        self.count += weight
        if self.robust and self.count <= self.horizon:
            self._first += [x] * weight
            self.value = statistics.median(self._first)
            return
        if self.robust:
            x = min(x, 2.0 * self.value)
        self.value += (x - self.value) * min(1.0, weight / min(self.count, self.horizon))

    def seed(self, x: float, count: int) -> None:
        """A start-up measurement: counts as `count` samples towards being measured, but enters the
        median as one, so the first real samples outvote it (warm-up ran on a synthetic prompt)."""
        if self.count == 0:
            self.count, self.value, self._first = count, x, [x]

    def reset(self) -> None:
        self.count, self.value, self._first = 0, 0.0, []


class PathChooser:
    """Per step: `choose(key)` -> "compiled" or "eager"; after the forward: `observe(key, path, seconds)`.

    key: (batch-size bucket, tokens per request). A path counts as unmeasured until `min_samples`
    forwards have run it (`seed` counts as that many); unmeasured paths run first, compiled first.
    pinned: always the compiled program (no exploring, nothing measured)."""

    PATHS = ("compiled", "eager")

    def __init__(self, explore_every: int = 32, min_samples: int = 3, pinned: bool = False,
                 explore_within: float = 1.5) -> None:
        self.explore_every, self.min_samples, self.pinned = explore_every, min_samples, pinned
        self.explore_within = explore_within
        self.times: dict[tuple[int, int], dict[str, RunningAverage]] = {}
        self.chosen: Counter[str] = Counter()
        self._steps: Counter[tuple[int, int]] = Counter()

    def _averages(self, key: tuple[int, int]) -> dict[str, RunningAverage]:
        return self.times.setdefault(key, {p: RunningAverage(horizon=10, robust=True) for p in self.PATHS})

    def seed(self, key: tuple[int, int], path: str, seconds: float) -> None:
        """A start-up timing (a median of several forwards): counts as `min_samples` samples towards
        being measured, but as one in the median, so real forwards outvote a start-up timing that a
        busy moment skewed (`RunningAverage.seed`)."""
        self._averages(key)[path].seed(seconds, self.min_samples)

    def best(self, key: tuple[int, int]) -> str:
        if self.pinned:
            return "compiled"
        avgs = self._averages(key)
        unmeasured = [p for p in self.PATHS if avgs[p].count < self.min_samples]
        if unmeasured:
            return unmeasured[0]
        return min(self.PATHS, key=lambda p: avgs[p].value)

    def explore_period(self, key: tuple[int, int]) -> int:
        """Steps between two forwards of the slower path: `explore_every`, times the slowdown (rounded
        up) once that exceeds `explore_within`, so a far slower path costs as little as a near one."""
        avgs = self._averages(key)
        fast, slow = sorted(a.value for a in avgs.values())
        slowdown = slow / fast if fast > 0 else 1.0
        return self.explore_every * (math.ceil(slowdown) if slowdown > self.explore_within else 1)

    def settled_on(self, key: tuple[int, int], path: str) -> bool:
        """Whether `path` is the one this key's steps run: pinned, or both paths measured and this one
        the faster. A forward on any other path explores it, and its step's time says nothing about
        the draft shape's cost (the engine keeps it out of `ShapeChooser`'s estimates: eager steps
        at 2-4x the program's time, counted there, locked drafting shapes out for good)."""
        if self.pinned:
            return True
        measured = all(a.count >= self.min_samples for a in self._averages(key).values())
        return measured and self.best(key) == path

    def choose(self, key: tuple[int, int]) -> str:
        path = self.best(key)
        if not self.pinned:
            self._steps[key] += 1
            if self._steps[key] >= self.explore_period(key):
                self._steps[key] = 0
                path = next(p for p in self.PATHS if p != path)
        self.chosen[path] += 1
        return path

    def observe(self, key: tuple[int, int], path: str, seconds: float) -> None:
        if not self.pinned:
            self._averages(key)[path].add(seconds)

    def summary(self) -> dict:
        """What the bench JSON reports: forwards per path, and per key each path's estimate (ms)."""
        return {
            "chosen": dict(sorted(self.chosen.items())),
            "forward_ms": {f"bs{b}:t{t}": {p: round(a.value * 1e3, 2) for p, a in avgs.items() if a.count}
                           for (b, t), avgs in sorted(self.times.items())},
        }
