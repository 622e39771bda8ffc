"""Start-up figures that are wrong are undone within tens of steps: the path chooser and the draft
shape chooser against stand-in costs (no model), and start-up timings that say the machine was busy
(stand-in clocks)."""

from __future__ import annotations

import logging
import random

import pytest

from specserve.draft_plan import shape_menu
from specserve.engine.adaptive import ShapeChooser
from specserve.estimates import Clocks, StartupTiming, time_interleaved
from specserve.runtime.paths import PathChooser

KEY = (1, 1)
BOUND = 50  # steps within which a wrong figure must be undone


def _run(chooser: PathChooser, cost, steps: int = 600) -> list[str]:
    """`steps` steps whose forwards cost cost(path, step) seconds, with one-sided noise (up to +30 %);
    best() after each."""
    noise = random.Random(0)
    bests = []
    for i in range(steps):
        path = chooser.choose(KEY)
        chooser.observe(KEY, path, cost(path, i) * (1.0 + 0.3 * noise.random()))
        bests.append(chooser.best(KEY))
    return bests


def _settled_after(bests: list[str], path: str) -> int:
    """The number of steps before best() returned `path` for good (len(bests) if it never did)."""
    i = len(bests)
    while i > 0 and bests[i - 1] == path:
        i -= 1
    return i


def _fixed(compiled: float, eager: float):
    return lambda path, _: compiled if path == "compiled" else eager


@pytest.mark.parametrize("compiled_seed", [1.5, 0.200, 0.090])  # 100x, 13x and 6x (within 4x of eager's)
def test_a_faster_path_seeded_far_too_slow_is_chosen_within_the_bound(compiled_seed):
    """The program costs 15 ms, eager 66 ms; a busy start-up timed the program far slower."""
    c = PathChooser()
    c.seed(KEY, "compiled", compiled_seed)
    c.seed(KEY, "eager", 0.066)
    assert c.best(KEY) == ("eager" if compiled_seed > 0.066 else "compiled")
    bests = _run(c, _fixed(0.015, 0.066))
    assert _settled_after(bests, "compiled") < BOUND
    assert c.times[KEY]["compiled"].value < 0.020  # the real forwards replaced the seed


@pytest.mark.parametrize("eager_seed", [0.00066, 0.005, 0.012])  # 100x, 13x, 5.5x too low
def test_a_slow_path_seeded_far_too_fast_is_left_within_the_bound(eager_seed):
    """Eager costs 66 ms but was timed far faster; the program costs 15 ms."""
    c = PathChooser()
    c.seed(KEY, "compiled", 0.015)
    c.seed(KEY, "eager", eager_seed)
    assert c.best(KEY) == "eager"
    bests = _run(c, _fixed(0.015, 0.066))
    assert _settled_after(bests, "compiled") < BOUND


def test_real_forwards_that_stalled_after_a_busy_start_are_undone_within_one_exploring_period():
    """A bench run's `none` after a busy start: both start-up figures inflated (6.6 s and 2.3 s), then
    the program's first three real forwards stalled (about 1 s each, the machine still settling),
    after which it costs 15 ms against eager's 42 ms. Before a faster forward restarted an
    estimate, the stalled forwards' median held the program off for the whole run (5 of 1,449 steps)."""
    c = PathChooser()
    c.seed(KEY, "compiled", 6.6)
    c.seed(KEY, "eager", 2.3)
    stalled = iter([1.0, 1.2, 0.9])

    def cost(path, _):
        return next(stalled, 0.015) if path == "compiled" else 0.042

    bests = _run(c, cost, steps=1500)
    stalls_taken = 3 * c.provisional_period  # explored that often until it has 3 real forwards
    period = c.explore_every * c.max_slowdown  # then at most this long until the next one
    settled = _settled_after(bests, "compiled")
    assert settled < stalls_taken + period  # measured: 321 of 1,500 steps


def test_a_figure_far_off_the_other_paths_is_re_timed_on_the_next_step():
    c = PathChooser()
    c.seed(KEY, "compiled", 3.513)  # the bench's skewed start-up timing
    c.seed(KEY, "eager", 0.066)
    assert c.best(KEY) == "eager" and c.choose(KEY) == "compiled"  # re-timed at once
    c.observe(KEY, "compiled", 0.015)
    assert c.best(KEY) == "compiled" and c.settled_on(KEY, "compiled")


def test_an_untried_near_tie_is_timed_on_the_next_step():
    """A drafting engine's plain step at batch 8: start-up timed the program 16.7 ms and eager
    16.4 ms; eager's real forwards take 15.2 ms, the program's 11.3 ms. The program is tried once
    eager has `min_samples` real forwards (before, it waited out the provisional period, longer
    than the whole bench), not on the key's second forward, which the engine's warm-up times."""
    c = PathChooser()
    c.seed(KEY, "compiled", 0.0167)
    c.seed(KEY, "eager", 0.0164)
    for _ in range(c.min_samples):
        assert c.choose(KEY) == "eager"
        c.observe(KEY, "eager", 0.0152)
        assert c.times[KEY]["eager"].samples < c.min_samples or c.settled_on(KEY, "eager")
    assert c.choose(KEY) == "compiled"
    c.observe(KEY, "compiled", 0.0113)
    assert c.best(KEY) == "compiled"
    far = PathChooser()  # a start-up figure 2x the other path's real forwards waits its turn
    far.seed(KEY, "compiled", 0.030)
    far.seed(KEY, "eager", 0.016)
    for _ in range(far.min_samples):
        far.observe(KEY, far.choose(KEY), 0.015)
    assert far.choose(KEY) == "eager"


def test_real_forwards_replace_the_seed_rather_than_join_its_median():
    c = PathChooser()
    c.seed(KEY, "compiled", 0.060)
    c.observe(KEY, "compiled", 0.015)
    assert c.times[KEY]["compiled"].value == 0.015 and not c.times[KEY]["compiled"].provisional
    c.seed(KEY, "compiled", 0.200)  # a seed after real forwards is ignored
    assert c.times[KEY]["compiled"].value == 0.015


def test_a_path_that_turns_slow_mid_run_is_dropped_within_the_bound():
    c = PathChooser()
    c.seed(KEY, "compiled", 0.015)
    c.seed(KEY, "eager", 0.040)
    bests = _run(c, lambda path, i: (0.015 if i < 300 else 0.066) if path == "compiled" else 0.040)
    assert bests[299] == "compiled"
    assert _settled_after(bests, "eager") - 300 < BOUND


def test_a_path_with_few_real_forwards_is_explored_within_the_provisional_period():
    """Start-up figures say eager is 6x slower (doubt_ratio 8 here: believed): it is still tried
    within `provisional_period` steps, not every 6 x explore_every."""
    c = PathChooser(explore_every=32, provisional_period=16, doubt_ratio=8.0)
    c.seed(KEY, "compiled", 0.010)
    c.seed(KEY, "eager", 0.060)
    picks = [c.choose(KEY) for _ in range(16)]
    assert picks.index("eager") == 15
    assert PathChooser(max_slowdown=4).explore_period((9, 9)) == 32  # nothing measured: no slowdown
    capped = PathChooser(explore_every=8, max_slowdown=4, min_samples=1)
    capped.observe(KEY, "compiled", 0.001)
    capped.observe(KEY, "eager", 0.100)
    assert capped.explore_period(KEY) == 32  # 100x slower, explored every 4 x 8 steps


def test_a_change_of_choice_is_logged_with_both_estimates(caplog):
    c = PathChooser()
    c.seed(KEY, "compiled", 0.015)
    c.seed(KEY, "eager", 0.040)
    with caplog.at_level(logging.INFO, logger="specserve.runtime.paths"):
        c.observe(KEY, "compiled", 0.066)
    assert "bs1:t1: compiled -> eager (compiled 66.0 ms, eager 40.0 ms)" in caplog.text


class _FakeClocks:
    """Clocks that each stand-in forward advances by its own wall, process and thread CPU time."""

    def __init__(self) -> None:
        self.wall = self.process = self.thread = 0.0

    def clocks(self) -> Clocks:
        return Clocks(wall=lambda: self.wall, process=lambda: self.process, thread=lambda: self.thread)

    def forward(self, walls: list[float], process: float, thread: float):
        calls = iter(walls)

        def run() -> None:
            self.wall += next(calls)
            self.process += process
            self.thread += thread
        return run


def test_a_timing_whose_wall_time_the_cpu_time_does_not_explain_is_flagged_busy():
    fake = _FakeClocks()
    forwards = {
        # 4 threads: 60 ms of process CPU explains 15 ms of wall
        "parallel": fake.forward([1.0, 1.0, 0.015, 0.016, 0.014], process=0.060, thread=0.012),
        # one thread computing, the others asleep: its own CPU time explains the wall time
        "serial": fake.forward([1.0, 1.0, 0.015, 0.015, 0.015], process=0.015, thread=0.015),
        # the process got a CPU a tenth of the time: another job ran
        "starved": fake.forward([1.0, 1.0, 0.100, 0.300, 0.150], process=0.020, thread=0.010),
    }
    timings = time_interleaved(forwards, repeats=3, untimed=2, threads=4, clocks=fake.clocks())
    assert not timings["parallel"].busy and not timings["serial"].busy and timings["starved"].busy
    assert timings["parallel"].repeats == pytest.approx((0.015, 0.016, 0.014))  # the untimed calls left out
    assert timings["starved"].summary() == {"min_ms": 100.0, "median_ms": 150.0, "max_ms": 300.0, "busy": True}
    assert "busy" in str(timings["starved"]) and "busy" not in str(timings["serial"])


def test_the_summary_keeps_the_start_up_spread_and_the_busy_flag():
    c = PathChooser()
    c.seed(KEY, "compiled", StartupTiming((3.4, 3.513, 3.6), explained_s=0.045))
    c.seed(KEY, "eager", StartupTiming((0.064, 0.066, 0.070), explained_s=0.200))
    summary = c.summary()
    assert summary["start_flagged"] and c.start_flagged
    assert summary["startup_ms"]["bs1:t1"]["compiled"] == {"min_ms": 3400.0, "median_ms": 3513.0, "max_ms": 3600.0,
                                                          "busy": True}
    assert not summary["startup_ms"]["bs1:t1"]["eager"]["busy"]
    assert summary["forward_ms"]["bs1:t1"] == {"compiled": 3513.0, "eager": 66.0}
    assert not PathChooser().summary()["start_flagged"]


@pytest.mark.parametrize("warm_up_s", [1.4, 0.0014])  # 100x too slow, 10x too fast
def test_a_draft_shape_with_a_skewed_warm_up_time_is_corrected_within_the_bound(warm_up_s):
    """Plain decoding 10 ms, drafts of 2, 3, 4 tokens 12, 14, 16 ms accepting 1.5, 2.4, 2.6 tokens:
    the 3-token draft is best (171 tokens/s), but its warm-up step was timed far off."""
    c = ShapeChooser(shape_menu(3, 1, 4), batch_buckets=(1,), drafts_catch_up=False)
    plain, two, three, four = c.menu
    cost = {plain: 0.010, two: 0.012, three: 0.014, four: 0.016}
    accept = {plain: 1, two: 1.5, three: 2.4, four: 2.6}
    for shape in c.menu:
        c.observe(1, shape, warm_up_s if shape == three else cost[shape], [1], warm_up=True)
    c.forget_acceptance()
    for shape in c.menu[1:]:
        for _ in range(c.min_samples):
            c.observe(1, shape, None, [accept[shape]])  # acceptance measured, no step time
    bests = []
    for _ in range(400):
        shape = c.choose(1)
        c.observe(1, shape, cost[shape], [accept[shape]])
        bests.append(c.best(1))
    i = len(bests)
    while i > 0 and bests[i - 1] == three:
        i -= 1
    assert i < BOUND


def test_shapes_known_only_by_their_warm_up_time_are_explored_first_plain_decoding_first():
    """A 3-token draft is best; plain decoding's warm-up step ran on a busy machine (1 s). The next
    explorations re-time the shapes known only by their warm-up figure, smallest first."""
    c = ShapeChooser(shape_menu(3, 1, 4), batch_buckets=(1,), explore_every=16, drafts_catch_up=False)
    plain, two, three, four = c.menu
    cost = {plain: 1.0, two: 0.012, three: 0.014, four: 0.016}
    for shape in c.menu:
        c.observe(1, shape, cost[shape], [1], warm_up=True)
    c.forget_acceptance()
    accept = {plain: 1, two: 1.5, three: 2.4, four: 2.6}
    for shape in c.menu[1:]:
        for _ in range(c.min_samples):
            c.observe(1, shape, None, [accept[shape]])
    picks = []
    for _ in range(48):
        picks.append(c.choose(1))
        c.observe(1, picks[-1], 0.010 if picks[-1] == plain else cost[picks[-1]], [accept[picks[-1]]])
    assert [picks[i] for i in (15, 31, 47)] == [plain, two, four]
    assert not any(c.step_time[(1, s)].provisional for s in c.menu)


def test_a_forward_of_untimed_rows_is_estimated_between_the_timed_ones():
    """`TargetRunner.forward_seconds`, what tree sizing weighs: the path the key runs, interpolated
    between the nearest row counts timed at the batch's bucket, nothing beyond them or off the CPU's
    compiled program."""
    from specserve.runtime.target import TargetRunner

    runner = TargetRunner.__new__(TargetRunner)  # no model: only the paths' estimates are read
    runner.graphs, runner.compiled, runner.buckets = None, object(), [1, 2, 4, 8]
    runner.paths = PathChooser()
    for rows, compiled in ((1, 0.004), (4, 0.007)):
        runner.paths.seed((1, rows), "compiled", compiled)
        runner.paths.seed((1, rows), "eager", 0.010)
    assert runner.paths.estimate((1, 1)) == 0.004 and runner.paths.estimate((1, 3)) is None
    assert runner.forward_seconds(1, 5) == pytest.approx([0.004, 0.005, 0.006, 0.007, None])
    assert runner.forward_seconds(2, 2) == [None, None]  # bucket 2: nothing timed
    runner.paths.observe((1, 4), "compiled", 0.012)  # a real forward replaces the start-up figure
    assert runner.forward_seconds(1, 4)[3] == 0.010  # the path it runs now: eager's
    runner.paths.seed((1, 2), "compiled", 0.011)  # a stalled figure above a larger count's
    runner.paths.seed((1, 2), "eager", 0.020)
    assert runner.forward_seconds(1, 4) == pytest.approx([0.004, 0.010, 0.010, 0.010])
    runner.compiled = None
    assert runner.forward_seconds(1, 2) == [None, None]


def test_compiled_only_never_runs_the_eager_path_and_keeps_timing_the_compiled_one():
    """A target whose tokens must all come out of the compiled programs (rounded activations): the eager
    path is never explored even where it looks faster, and the compiled forwards still size the drafts."""
    chooser = PathChooser(compiled_only=True)
    chooser.seed(KEY, "eager", 0.001)
    bests = _run(chooser, _fixed(compiled=0.010, eager=0.001), steps=300)
    assert set(bests) == {"compiled"} and chooser.chosen == {"compiled": 300}
    assert chooser.estimate(KEY) == pytest.approx(0.0115, rel=0.2)
    assert chooser.settled_on(KEY, "compiled") and not chooser.settled_on(KEY, "eager")
    assert PathChooser(pinned=True).estimate(KEY) is None  # pinned measures nothing
