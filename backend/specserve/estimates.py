"""Online cost estimates: what the choosers and budgets of the engine and runtime believe a step costs.

- `RunningAverage`: a mean, then an exponential moving average; `robust` for times (one-sided
  noise); start-up figures stand in until the first real sample (the draft-shape chooser, the
  path chooser, the prefill budget's decode step).
- `LinearFit`: seconds = fixed part + cost per unit, least squares over a window (the prefill
  budget's prompt work).
- `time_interleaved`: start-up timings of a few candidates, interleaved round by round, with
  whether the machine looked busy (the path chooser's seeds, the head's catch-up chunking).

Nothing here reads a clock by itself except `time_interleaved` (through `Clocks`, which tests
replace) or knows what is being timed.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

BUSY_FACTOR = 2.0  # wall time above this many times what the CPU time explains: the process waited for a CPU


class RunningAverage:
    """A running mean over the first `horizon` samples, then an exponential moving average.

    robust (for times, whose noise is one-sided: a step is never faster than its work, often
    slower): the median of the first `horizon` samples, then a moving average of samples clipped
    to twice the estimate. A sample of weight w counts as w equal samples.

    A start-up figure (`seed`) stands in until the first real sample, which replaces it: `count`
    counts it as its weight towards being measured, `samples` counts real samples only."""

    def __init__(self, horizon: int, robust: bool = False) -> None:
        self.horizon, self.robust = horizon, robust
        self.samples, self.value, self.seed_weight = 0, 0.0, 0
        self._first: list[float] = []

    @property
    def count(self) -> int:
        """Samples towards being measured: the real ones, or the seed's weight while more."""
        return max(self.samples, self.seed_weight)

    @property
    def provisional(self) -> bool:
        """Whether the value is a start-up figure no real sample has checked yet."""
        return self.seed_weight > 0 and self.samples == 0

    def add(self, x: float, weight: int = 1) -> None:
        self.samples += weight
        if self.robust and self.samples <= self.horizon:
            self._first += [x] * weight
            self.value = statistics.median(self._first)
            return
        if self.robust:
            x = min(x, 2.0 * self.value)
        self.value += (x - self.value) * min(1.0, weight / min(self.samples, self.horizon))

    def seed(self, x: float, weight: int) -> None:
        """A start-up measurement, counted as `weight` samples towards being measured until the first
        real sample replaces it (warm-up ran on a synthetic prompt, perhaps on a busy machine). A
        later seed replaces an earlier one; once real samples exist, seeds are ignored."""
        if self.samples == 0:
            self.value, self.seed_weight = x, weight

    def reset(self) -> None:
        self.samples, self.value, self.seed_weight, self._first = 0, 0.0, 0, []


@dataclass(frozen=True)
class Clocks:
    """What a start-up timing reads: wall time, the process's CPU time (every thread's), and the
    calling thread's CPU time."""

    wall: Callable[[], float] = time.perf_counter
    process: Callable[[], float] = time.process_time
    thread: Callable[[], float] = time.thread_time


@dataclass(frozen=True)
class StartupTiming:
    """One path's start-up timing at one key: each timed repeat's wall time (seconds), and the wall
    time their CPU time explains (per repeat the larger of the calling thread's CPU time and the
    process's divided by the threads it computes with)."""

    repeats: tuple[float, ...]
    explained_s: float

    @property
    def median_s(self) -> float:
        return statistics.median(self.repeats)

    @property
    def busy(self) -> bool:
        """Wall time more than `BUSY_FACTOR` times what the CPU time explains: the process waited
        for a CPU (another job ran), so the figure overstates the path's cost."""
        return sum(self.repeats) > BUSY_FACTOR * self.explained_s

    def summary(self) -> dict:
        ms = [round(r * 1e3, 2) for r in (min(self.repeats), self.median_s, max(self.repeats))]
        return {"min_ms": ms[0], "median_ms": ms[1], "max_ms": ms[2], "busy": self.busy}

    def __str__(self) -> str:
        return (f"{self.median_s * 1e3:.1f} ms ({min(self.repeats) * 1e3:.1f}-{max(self.repeats) * 1e3:.1f})"
                + (" busy" if self.busy else ""))


def time_interleaved(forwards: Mapping[str, Callable[[], object]], repeats: int, untimed: int = 2, threads: int = 1,
                     clocks: Clocks = Clocks()) -> dict[str, StartupTiming]:
    """Each forward `untimed` times, then `repeats` timed times, interleaved round by round (a busy
    spell weighs on every path alike). threads: the threads the forwards compute with."""
    walls: dict[str, list[float]] = {name: [] for name in forwards}
    explained = dict.fromkeys(forwards, 0.0)
    for i in range(untimed + repeats):
        for name, forward in forwards.items():
            wall, process, thread = clocks.wall(), clocks.process(), clocks.thread()
            forward()
            if i >= untimed:
                walls[name].append(clocks.wall() - wall)
                explained[name] += max(clocks.thread() - thread, (clocks.process() - process) / max(threads, 1))
    return {name: StartupTiming(tuple(walls[name]), explained[name]) for name in forwards}


class LinearFit:
    """y = intercept + slope * x, least squares over the last `window` samples; where the samples'
    x do not differ, or the fit would make either part negative, y / x alone (intercept 0)."""

    def __init__(self, window: int) -> None:
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)
        self.slope: float | None = None  # None until the first sample
        self.intercept = 0.0

    def add(self, x: float, y: float) -> None:
        self.samples.append((float(x), y))
        xs, ys = [a for a, _ in self.samples], [b for _, b in self.samples]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((a - mean_x) ** 2 for a in xs)
        slope = sum((a - mean_x) * (b - mean_y) for a, b in zip(xs, ys)) / var if var > 0 else 0.0
        if slope > 0 and mean_y - slope * mean_x >= 0:
            self.slope, self.intercept = slope, mean_y - slope * mean_x
        else:
            self.slope, self.intercept = mean_y / mean_x, 0.0
