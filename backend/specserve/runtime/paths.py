"""Which path the target's forward takes on a CPU: the compiled step program or eager PyTorch.

Neither is faster on every CPU, and on some the program's speed differs from one process to the
next, so a timing taken at start-up only seeds the choice: each (batch-size bucket, tokens per
request) key runs its faster measured path and, every `explore_every`-th step, the other, so a
path that turns slow is left within a few dozen steps. A path measured more than
`explore_within` times slower is tried that much less often (at most `max_slowdown` times), so
exploring costs about 1/`explore_every` of a step whatever the gap.

A start-up figure is provisional: the path's first real forward replaces it (it is never
averaged with real forwards), a figure more than `doubt_ratio` times the other path's is re-timed
on the key's next step before it is believed, one within `explore_within` of the other path's
real forwards (a near tie) once that path has `min_samples` of them, and while a path has fewer
than `min_samples` real forwards it is explored at least every `provisional_period` steps. So a
start-up timing that a busy moment skewed costs a few dozen steps, not thousands. Real forwards can stall too (the
machine still busy, a program's pages read back in): a forward more than `doubt_ratio` times
faster than its path's estimate restarts that estimate, so stalled forwards cost at most one
exploring period.

Its estimates are `specserve.estimates`' (`RunningAverage`; start-up figures from
`time_interleaved`). The chooser measures nothing itself: the runtime reports each forward's path
and time.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import Counter

from specserve.estimates import RunningAverage, StartupTiming

log = logging.getLogger(__name__)

class PathChooser:
    """Per step: `choose(key)` -> "compiled" or "eager"; after the forward: `observe(key, path, seconds)`.

    key: (batch-size bucket, tokens per request). A path counts as unmeasured until `min_samples`
    forwards have run it (`seed` counts as that many); unmeasured paths run first, compiled first.
    pinned: always the compiled program (no exploring, nothing measured). compiled_only: always the
    compiled program, its forwards still measured (for a target whose tokens must come out of one
    program bit for bit: `runtime.target`). This class keeps no clock: the runtime times each forward."""

    PATHS = ("compiled", "eager")

    def __init__(self, explore_every: int = 32, min_samples: int = 3, pinned: bool = False,
                 explore_within: float = 1.5, max_slowdown: int = 8, provisional_period: int = 32,
                 doubt_ratio: float = 4.0, compiled_only: bool = False) -> None:
        self.explore_every, self.min_samples, self.pinned = explore_every, min_samples, pinned
        self.compiled_only = compiled_only
        self.explore_within, self.max_slowdown = explore_within, max_slowdown
        self.provisional_period, self.doubt_ratio = provisional_period, doubt_ratio
        self.times: dict[tuple[int, int], dict[str, RunningAverage]] = {}
        self._rows: dict[int, list[int]] = {}  # per batch-size bucket, its timed tokens per request, ascending
        self._estimates: dict[tuple[int, int], float | None] = {}  # `estimate` per key, until its next forward
        self.startup: dict[tuple[int, int], dict[str, StartupTiming]] = {}
        self.chosen: Counter[str] = Counter()
        self._steps: Counter[tuple[int, int]] = Counter()
        self._settled: dict[tuple[int, int], str] = {}  # the last path each key settled on (for the log)

    def _averages(self, key: tuple[int, int]) -> dict[str, RunningAverage]:
        avgs = self.times.get(key)
        if avgs is None:  # not setdefault: its default would be built on every call (a step makes dozens)
            avgs = self.times[key] = {p: RunningAverage(horizon=10, robust=True) for p in self.PATHS}
            bisect.insort(self._rows.setdefault(key[0], []), key[1])
        return avgs

    def seed(self, key: tuple[int, int], path: str, timing: float | StartupTiming) -> None:
        """A start-up timing (seconds, or a `StartupTiming` whose median counts): it stands for
        `min_samples` forwards until the path's first real forward replaces it."""
        if isinstance(timing, StartupTiming):
            self.startup.setdefault(key, {})[path] = timing
            timing = timing.median_s
        self._averages(key)[path].seed(timing, self.min_samples)
        self._estimates.pop(key, None)
        if self._believed(key):
            self._settled[key] = self.best(key)

    def _doubted(self, key: tuple[int, int]) -> bool:
        """Whether the slower-looking path's figure is a start-up one more than `doubt_ratio` times
        the other's: the next step re-times it before it is believed (the faster-looking path runs
        anyway, so its own figure is checked by the step after)."""
        fast, slow = sorted(self._averages(key).values(), key=lambda a: a.value)
        return slow.provisional and fast.count > 0 and slow.value > self.doubt_ratio * fast.value

    def _untried_near_tie(self, key: tuple[int, int]) -> bool:
        """Whether the slower-looking path is known only by its start-up figure, within
        `explore_within` of the other path's `min_samples` real forwards: one forward settles a tie
        that a skewed start-up timing may have decided. (A drafting engine's plain steps are rare, so
        their keys could run the wrong path for a whole bench before the provisional period came
        round.) Not sooner: the engine's warm-up times each shape on a key's second forward, which
        must run the settled path to count."""
        fast, slow = sorted(self._averages(key).values(), key=lambda a: a.value)
        return (slow.provisional and fast.samples >= self.min_samples
                and slow.value <= self.explore_within * fast.value)

    def _believed(self, key: tuple[int, int]) -> bool:
        """Whether every path of `key` is measured (the choice between them is then by estimate)."""
        return all(a.count >= self.min_samples for a in self._averages(key).values())

    def best(self, key: tuple[int, int]) -> str:
        if self.pinned or self.compiled_only:
            return "compiled"
        avgs = self._averages(key)
        best, best_value = self.PATHS[0], math.inf
        for path in self.PATHS:  # the first unmeasured path, else the fastest (the first of a tie)
            avg = avgs[path]
            if avg.count < self.min_samples:
                return path
            if avg.value < best_value:
                best, best_value = path, avg.value
        return best

    def estimate(self, key: tuple[int, int]) -> float | None:
        """The seconds a forward of `key` is expected to take on the path it runs (None: not timed yet)."""
        if key in self._estimates:
            return self._estimates[key]
        avg = self._averages(key)[self.best(key)] if key in self.times else None
        value = self._estimates[key] = avg.value if avg is not None and avg.count else None
        return value

    def estimates(self, bucket: int) -> list[tuple[int, float]]:
        """(tokens per request, `estimate`) of every timed key of a batch-size bucket, tokens ascending."""
        return [(t, e) for t in self._rows.get(bucket, ()) if (e := self.estimate((bucket, t))) is not None]

    def explore_period(self, key: tuple[int, int]) -> int:
        """Steps between two forwards of the slower path: `explore_every`, times the slowdown (rounded
        up, at most `max_slowdown`) once that exceeds `explore_within`, so a far slower path costs as
        little as a near one; at most `provisional_period` while a path has fewer than `min_samples`
        real forwards (a start-up figure, or one real forward, may be far off); 1 while the slower
        path's start-up figure is doubted or an untried near tie."""
        if self._doubted(key) or self._untried_near_tie(key):
            return 1
        avgs = self._averages(key)
        fast, slow = sorted(a.value for a in avgs.values())
        slowdown = slow / fast if fast > 0 else 1.0
        period = self.explore_every * (
            min(math.ceil(slowdown), self.max_slowdown) if slowdown > self.explore_within else 1
        )
        if any(a.samples < self.min_samples for a in avgs.values()):
            period = min(period, self.provisional_period)
        return period

    def settled_on(self, key: tuple[int, int], path: str) -> bool:
        """Whether `path` is the one this key's steps run: pinned, or both paths measured and this one
        the faster. A forward on any other path explores it, and its step's time says nothing about
        the draft shape's cost (the engine keeps it out of `ShapeChooser`'s estimates: eager steps
        at 2-4x the program's time, counted there, locked drafting shapes out for good)."""
        if self.pinned or self.compiled_only:
            return path == "compiled"
        return self._believed(key) and self.best(key) == path

    def choose(self, key: tuple[int, int]) -> str:
        path = self.best(key)
        if not (self.pinned or self.compiled_only):
            self._steps[key] += 1
            if self._steps[key] >= self.explore_period(key):
                self._steps[key] = 0
                path = next(p for p in self.PATHS if p != path)
        self.chosen[path] += 1
        return path

    def observe(self, key: tuple[int, int], path: str, seconds: float) -> None:
        """A forward's time. One more than `doubt_ratio` times faster than the path's estimate says
        that estimate came from stalled forwards (a busy spell, programs paged back in after one):
        the path is measured afresh from this forward, as a start-up figure is replaced."""
        if not self.pinned:
            avg = self._averages(key)[path]
            if avg.samples and seconds * self.doubt_ratio < avg.value:
                avg.reset()
            avg.add(seconds)
            self._estimates.pop(key, None)
            self._log_switch(key)

    def _log_switch(self, key: tuple[int, int]) -> None:
        """Log a key's change of settled path, with both estimates."""
        if not self._believed(key):
            return
        path, before = self.best(key), self._settled.get(key)
        if path != before:
            self._settled[key] = path
            avgs = self._averages(key)
            log.info("bs%d:t%d: %s -> %s (%s)", key[0], key[1], before or "unmeasured", path,
                     ", ".join(f"{p} {avgs[p].value * 1e3:.1f} ms" for p in self.PATHS))

    @property
    def start_flagged(self) -> bool:
        """Whether any start-up timing was taken while the machine looked busy."""
        return any(t.busy for timings in self.startup.values() for t in timings.values())

    def summary(self) -> dict:
        """What the bench JSON reports: forwards per path, per key each path's estimate (ms), the
        start-up timings' spread and busy flags, and whether any was flagged."""
        return {
            "chosen": dict(sorted(self.chosen.items())),
            "forward_ms": {f"bs{b}:t{t}": {p: round(a.value * 1e3, 2) for p, a in avgs.items() if a.count}
                           for (b, t), avgs in sorted(self.times.items())},
            "startup_ms": {f"bs{b}:t{t}": {p: timing.summary() for p, timing in timings.items()}
                           for (b, t), timings in sorted(self.startup.items())},
            "start_flagged": self.start_flagged,
        }
