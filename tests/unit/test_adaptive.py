"""Cost-aware speculation: the chooser's arithmetic, and engines whose shapes change every few
steps staying lossless (float32, every algorithm, batch 1 and 4)."""

from __future__ import annotations

import time

import pytest
import torch

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.draft_plan import shape_menu
from specserve.engine.adaptive import ShapeChooser
from specserve.engine.engine import Engine
from specserve.runtime.paths import PathChooser
from specserve.tree import DraftShape, DraftTree


def test_menu_is_the_configured_tree_at_smaller_budgets():
    assert [str(s) for s in shape_menu(5, 4, 8)] == ["0/1/1", "1/4/2", "2/4/3", "3/4/4", "5/4/6", "5/4/8"]
    assert [str(s) for s in shape_menu(1, 1, 2)] == ["0/1/1", "1/1/2"]
    assert [s.num_draft_tokens for s in shape_menu(11, 1, 12)] == [1, 2, 3, 4, 6, 8, 12]


def _chooser(explore_every=1000, min_samples=1):
    return ShapeChooser(shape_menu(3, 1, 4), batch_buckets=(1, 2, 4), explore_every=explore_every,
                        min_samples=min_samples)


def test_picks_the_shape_with_most_tokens_per_second_and_plain_decoding_when_drafts_do_not_pay():
    c = _chooser()
    none, two, four = c.menu[0], c.menu[1], c.menu[3]
    assert c.best(1) == none  # unmeasured shapes are tried first, smallest first
    c.observe(1, none, 0.010, [1])  # 100 tokens/s
    c.observe(1, c.menu[2], 0.030, [1, 1])  # 33 tokens/s
    c.observe(1, four, 0.030, [1])
    c.observe(1, two, 0.012, [2, 1])  # 1.5 / 12 ms = 125 tokens/s
    assert c.best(1) == two
    for _ in range(40):
        c.observe(1, two, 0.012, [1])  # its acceptance collapses: 83 tokens/s
    assert c.best(1) == none
    assert c.best(4) == none  # batch bucket 4 has measured nothing yet: smallest first


def test_costs_are_kept_per_batch_bucket():
    c = _chooser()
    for bs, t_none, t_two in ((1, 0.010, 0.011), (4, 0.020, 0.045)):
        c.observe(bs, c.menu[0], t_none, [1] * bs)
        c.observe(bs, c.menu[1], t_two, [2] * bs)
        for shape in c.menu[2:]:
            c.observe(bs, shape, 1.0, [1] * bs)
    assert c.best(1) == c.menu[1]  # 2 tokens in 11 ms beats 1 in 10
    assert c.best(3) == c.menu[0] and c.best(4) == c.menu[0]  # 3 -> bucket 4: 2 in 45 ms loses to 1 in 20


def test_a_nested_drafters_step_measures_the_acceptance_of_every_smaller_shape():
    c = ShapeChooser(shape_menu(5, 4, 8), batch_buckets=(1, 2))
    menu = {str(s): s for s in c.menu}
    # two requests drafted 8 nodes: one accepted nodes 1 and 5 (+ bonus), the other node 2 only
    c.observe(2, menu["5/4/8"], 0.03, [3, 2], accepted_nodes=[[0, 1, 5], [0, 2]])
    got = {k: round(a.value, 3) for k, a in c.accept.items() if a.count}
    # budget n keeps nodes below n: 2 -> node 1 only (2, 1), 3 -> (2, 2), 4 and 6 -> (2, 2); 8 as verified
    assert {str(k): v for k, v in got.items()} == {"1/4/2": 1.5, "2/4/3": 2.0, "3/4/4": 2.0, "5/4/6": 2.5,
                                                   "5/4/8": 2.5}
    assert c.accept[menu["0/1/1"]].count == 0  # plain decoding needs no acceptance
    c.observe(1, menu["1/4/2"], 0.02, [2], accepted_nodes=[[0, 1]])
    assert c.accept[menu["5/4/8"]].count == 2  # a small step says nothing about larger budgets


def test_exploration_visits_the_neighbours_of_the_best_shape():
    c = _chooser(explore_every=4)
    for shape in c.menu:
        c.observe(1, shape, 0.010 * shape.num_draft_tokens, [1.8])
    picks = [c.choose(1) for _ in range(49)]
    # plain decoding is best: explored after 16 steps, then 32 (it stayed best), for two steps each (the
    # first catches up on the plain steps, the second is the one timed), with its only neighbour
    assert [i for i, shape in enumerate(picks) if shape != c.menu[0]] == [15, 16, 47, 48]
    assert set(picks) == {c.menu[0], c.menu[1]}
    assert sum(c.chosen.values()) == 49
    c = _chooser(explore_every=4)
    for shape, seconds, accept in zip(c.menu, (0.010, 0.020, 0.030, 0.040), (1, 1.95, 3.6, 4.4)):
        c.observe(1, shape, seconds, [accept])  # 100, 97.5, 120, 110 tokens/s: a drafting shape is best
    picks = [c.choose(1) for _ in range(16)]  # explored every 4th step: both neighbours within 80 %, plain decoding
    assert picks.count(c.menu[2]) == 12 and set(picks) == set(c.menu)


def test_off_menu_shapes_are_ignored():
    c = _chooser()
    c.observe(1, DraftShape(64, 9, 8), 0.5, [3])
    assert c.summary()["step_ms"] == {}


def _engine(tiny_target_dir, algorithm, batch, **spec):
    return Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", cpu_compile=False,
                               max_batch_size=batch, max_seq_len=256, spec=SpecConfig(algorithm=algorithm, **spec)))


def _drafter_spec(tmp_path, algorithm):
    from test_eagle import write_checkpoint  # tests/unit is on sys.path

    if algorithm in ("eagle", "eagle3"):
        return {"drafter_path": str(write_checkpoint(tmp_path / algorithm, algorithm))}
    return {}


@pytest.mark.parametrize("batch", [1, 4, 8])
@pytest.mark.parametrize("algorithm", ["ngram", "eagle", "eagle3", "standalone"])
def test_adaptive_shapes_are_lossless(tmp_path, tiny_target_dir, algorithm, batch):
    """Shapes change every other step (exploration forced); outputs equal plain decoding."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() * 3 for n in (4, 7, 5, 9, 6, 8, 3, 5, 6)]  # repetitive
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    eng = _engine(tiny_target_dir, algorithm, batch, **_drafter_spec(tmp_path, algorithm))
    assert len(eng.chooser.menu) > 2
    eng.chooser.explore_every = 2
    outs = eng.generate(prompts, params)
    ref = _engine(tiny_target_dir, "none", batch).generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert len(eng.chooser.chosen) >= 2  # the run really switched shapes


def test_pinned_shape_is_the_only_one(tiny_target_dir):
    eng = _engine(tiny_target_dir, "ngram", 2, num_draft_tokens=6)
    assert eng.chooser.menu == (DraftShape(6, 5, 1),)
    assert len(_engine(tiny_target_dir, "ngram", 2, adaptive=False).chooser.menu) == 1


def test_a_drafter_that_costs_more_than_it_saves_is_left_idle(tmp_path, tiny_target_dir):
    """Drafting made 20 ms slower per step: the engine settles on plain decoding, and the EAGLE
    drafter is not run while it does (its catch-up waits for the next draft)."""
    eng = _engine(tiny_target_dir, "eagle3", 1, **_drafter_spec(tmp_path, "eagle3"))
    propose, calls = eng.drafter.propose, []

    def slow(seqs, shape):  # noqa: ANN001, ANN202
        calls.append(shape)
        time.sleep(0.02)
        return propose(seqs, shape)

    eng.drafter.propose = slow
    eng.warm_up()  # remeasure with the slow drafter
    calls.clear()
    params = SamplingParams(max_tokens=160, ignore_eos=True)
    out = eng.generate([list(range(10, 40))], params)[0]
    plain = eng.chooser.chosen[eng.chooser.menu[0]]
    drafting_shapes = len(eng.chooser.menu) - 1
    # each drafting shape's acceptance is measured min_samples times, then only exploration drafts
    assert out.num_verify_steps - plain <= eng.chooser.min_samples * drafting_shapes + out.num_verify_steps // 16
    assert plain >= 0.8 * out.num_verify_steps
    assert len(calls) <= out.num_verify_steps - plain  # only those steps drafted
    ref = _engine(tiny_target_dir, "none", 1).generate([list(range(10, 40))], params)
    assert out.token_ids == ref[0].token_ids


def test_drafts_that_catch_up_on_skipped_tokens_do_not_count_in_their_shapes_time(tmp_path, tiny_target_dir):
    """A request's first draft (its drafter catches up over the whole prompt) and a draft after
    plain steps (over the tokens it skipped) cost the switch, not the shape's steady state: their
    time is left out, their acceptance counts; drafts after drafts count."""
    eng = _engine(tiny_target_dir, "eagle", 1, **_drafter_spec(tmp_path, "eagle"))
    plain, draft = eng.chooser.menu[0], eng.chooser.menu[-1]
    plan = [draft, draft, draft, plain, plain, draft, draft, plain, draft]
    picks, seen = iter(plan), []
    observe = eng.chooser.observe

    def spy(batch_size, shape, seconds, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append((shape, seconds))
        return observe(batch_size, shape, seconds, *args, **kwargs)

    eng.chooser.choose = lambda batch_size: next(picks)
    eng.chooser.observe = spy
    eng.generate([list(range(10, 70))], SamplingParams(max_tokens=len(plan) + 1, ignore_eos=True))
    assert [shape for shape, _ in seen] == plan
    counted = [seconds is not None for _, seconds in seen]
    assert counted == [False, True, True, True, True, False, True, True, False]


def test_a_drafter_without_catch_up_has_every_draft_timed(tiny_target_dir):
    """NGRAM reads the tokens themselves, so a draft after plain steps costs what any draft costs."""
    eng = _engine(tiny_target_dir, "ngram", 1)
    assert not eng.drafter.catches_up and not eng.chooser.drafts_catch_up
    plain, draft = eng.chooser.menu[0], eng.chooser.menu[-1]
    plan = [draft, plain, draft, draft]
    picks, seen = iter(plan), []
    observe = eng.chooser.observe
    eng.chooser.choose = lambda batch_size: next(picks)
    eng.chooser.observe = lambda bs, shape, seconds, *a, **kw: (seen.append(seconds),
                                                                 observe(bs, shape, seconds, *a, **kw))
    eng.generate([list(range(10, 70))], SamplingParams(max_tokens=len(plan) + 1, ignore_eos=True))
    assert len(seen) >= 3 and all(seconds is not None for seconds in seen)  # step 3 drafted after a plain one


def test_a_step_whose_drafter_finds_nothing_counts_as_plain_decoding(tiny_target_dir):
    """NGRAM drafts only after a suffix seen before: a step without one verifies the root alone, so it
    stands for plain decoding's time, and says nothing of the draft shape's acceptance."""
    eng = _engine(tiny_target_dir, "ngram", 1)
    draft = eng.chooser.menu[-1]
    seen = []
    observe = eng.chooser.observe
    eng.chooser.choose = lambda batch_size: draft
    eng.chooser.observe = lambda bs, shape, *a, **kw: (seen.append(shape), observe(bs, shape, *a, **kw))
    eng.drafter.propose = lambda seqs, shape=None: [DraftTree.root_only(s.token_ids[-1]) for s in seqs]
    eng.generate([list(range(10, 70))], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(seen) == 3 and all(shape == eng.chooser.menu[0] for shape in seen)
    assert eng.chooser.accept[draft].count == 0


def _drafting_steps(steps: int, plain_at: dict[int, bool]) -> list[int]:
    """The steps that drafted under a chooser whose drafts pay (explored every 4th step while plain
    decoding is best): at step i in `plain_at` the chosen draft did not run, its drafter having declined
    it by cost where the value is True, found nothing to draft where False."""
    c = ShapeChooser(shape_menu(3, 1, 4), batch_buckets=(1,), explore_every=4, min_samples=1, drafts_catch_up=False)
    for shape in c.menu:
        c.observe(1, shape, 0.010 * shape.num_draft_tokens, [1.8])
    plain = c.menu[0]
    picks = []
    for i in range(steps):
        picks.append(c.choose(1))
        ran = plain if i in plain_at else picks[-1]
        c.observe(1, ran, 0.010 * ran.num_draft_tokens, [1.8] if ran.drafts else [1], declined=plain_at.get(i, False))
    return [i for i, shape in enumerate(picks) if shape != plain]


def test_an_explored_draft_that_did_not_run_is_tried_at_the_next_step():
    """An exploration whose step decoded plainly (nothing to draft, or a grammar's forced text took
    the step) is tried again until it drafts: otherwise a drafter that drafts only now and then would
    almost never be measured."""
    # the first exploration's first two steps drafted nothing
    assert _drafting_steps(33, {3: False, 4: False}) == [3, 4, 5, 7, 11, 15, 19, 23, 27, 31]


def test_an_explored_draft_its_drafter_declined_by_cost_is_not_tried_again():
    """A drafter that sizes its trees by the step's costs and found none worth it answered the
    exploration: retrying at every step would pay its lookup every step for the same answer."""
    assert _drafting_steps(12, {3: True}) == [3, 7, 11]


def test_a_draft_must_beat_plain_decoding_by_the_margin():
    c = ShapeChooser(shape_menu(1, 1, 2), batch_buckets=(1,), margin=0.05, min_samples=1)
    c.observe(1, c.menu[0], 0.010, [1])  # 100 tokens/s
    c.observe(1, c.menu[1], 0.0100, [1.03])  # 103: a near-tie
    assert c.best(1) == c.menu[0]
    for _ in range(40):
        c.observe(1, c.menu[1], 0.0100, [1.08])  # 108: a clear gain
    assert c.best(1) == c.menu[1]


def test_warm_up_timings_stand_and_acceptance_is_measured_afresh_smallest_first():
    c = _chooser(min_samples=2)
    for shape in c.menu:
        c.observe(1, shape, 0.010, [4], warm_up=True)  # a repetitive warm-up prompt: every draft looks great
    c.forget_acceptance()
    picks = []
    for _ in range(5):
        picks.append(c.choose(1))
        c.observe(1, picks[-1], 0.010, [1])  # real text: drafts accept nothing
    # the warm-up's times count as measured; the smallest drafting shape's acceptance is measured,
    # and as it accepts nothing, no larger shape could do better: plain decoding from then on
    assert picks == [c.menu[1]] * 2 + [c.menu[0]] * 3
    assert c.accept[c.menu[2]].count == 0 and c.accept[c.menu[3]].count == 0


def test_where_drafts_cost_far_more_than_they_could_win_larger_shapes_are_never_run():
    """Batch 4 on a small CPU: a draft step costs 1.2-2x a plain one. One step of the smallest draft
    measures its acceptance on all four requests; its bound rules the larger shapes out."""
    c = _chooser(min_samples=3)
    for shape, seconds in zip(c.menu, (0.035, 0.043, 0.060, 0.070)):
        c.observe(4, shape, seconds, [1] * 4, warm_up=True)
    c.forget_acceptance()
    picks = []
    for _ in range(20):
        picks.append(c.choose(4))
        c.observe(4, picks[-1], None, [1, 1, 1, 2] if picks[-1].drafts else [1] * 4)
    assert picks == [c.menu[1]] + [c.menu[0]] * 19  # 1.25 in 43 ms loses to 1 in 35
    assert c.accept[c.menu[1]].count == 4
    # the bound: 0.25 tokens per draft node, times 2 and 3 nodes, at most 1 + the depth
    assert c.acceptance_bound(c.menu[2]) == pytest.approx(1.5) and c.acceptance_bound(c.menu[3]) == pytest.approx(1.75)
    assert c.acceptance_bound(c.menu[1]) is None  # nothing smaller measured: always worth a try


def test_a_drafter_without_catch_up_explores_a_draft_for_one_step_every_explore_every_steps():
    """NGRAM or suffix decoding: a draft tried from plain decoding costs only its rows in one verification,
    so plain decoding explores as often as a draft does (a drafter with a model: 4x less often)."""
    c = ShapeChooser(shape_menu(3, 1, 4), batch_buckets=(1,), explore_every=4, min_samples=1, drafts_catch_up=False)
    for shape in c.menu:
        c.observe(1, shape, 0.010 * shape.num_draft_tokens, [1.8])
    picks = [c.choose(1) for _ in range(33)]
    assert [i for i, shape in enumerate(picks) if shape != c.menu[0]] == [3, 7, 11, 15, 19, 23, 27, 31]


def test_a_catching_up_drafter_explores_ever_less_often_while_plain_decoding_stays_best():
    """Each exploration from plain decoding pays a catch-up: the period doubles (16, 32, 64 steps
    here, then stays at 64) while plain decoding stays best, and is back to 16 once a draft was best."""
    c = ShapeChooser(shape_menu(3, 1, 4), batch_buckets=(1,), explore_every=4, min_samples=1)
    for shape in c.menu:
        c.observe(1, shape, 0.010 * shape.num_draft_tokens, [1.8])  # 2 tokens: 90 tokens/s against 100
    picks = [c.choose(1) for _ in range(180)]
    assert [i for i, shape in enumerate(picks) if shape.drafts] == [15, 16, 47, 48, 111, 112, 175, 176]
    two = c.menu[1]
    for _ in range(5):
        c.observe(1, two, 0.012, [3])  # drafting pays now
    c._steps = 0  # (no exploration on the next step)
    assert c.choose(1) == two
    for _ in range(100):
        c.observe(1, two, 0.012, [1])  # and no longer
    c._steps = 0
    picks = [c.choose(1) for _ in range(17)]
    assert [i for i, shape in enumerate(picks) if shape.drafts] == [15, 16]


def test_one_unlucky_step_does_not_lock_a_shape_out():
    c = _chooser(min_samples=3)
    none, four = c.menu[0], c.menu[3]
    for _ in range(3):
        c.observe(1, none, 0.010, [1])  # 100 tokens/s
    for shape in c.menu[1:3]:
        for _ in range(3):
            c.observe(1, shape, 0.020, [1])  # 50 tokens/s
    c.observe(1, four, 0.015, [1])  # its first request rejects everything: 67 tokens/s so far
    assert c.best(1) == four  # still unmeasured: tried again
    c.observe(1, four, 0.015, [3])
    c.observe(1, four, 0.015, [3])  # 2.33 / 15 ms = 156 tokens/s
    assert c.best(1) == four


def test_one_slow_step_does_not_lock_plain_decoding_out():
    """A first call on a new shape, or a busy host, can make one step several times slower: the
    time estimate is the median of the first samples, and later a slow step moves it a tenth at most."""
    c = _chooser(min_samples=3)
    none = c.menu[0]
    for seconds in (0.050, 0.010, 0.010):  # the first plain step ran five times slower
        c.observe(1, none, seconds, [1])
    for shape in c.menu[1:]:
        for _ in range(3):
            c.observe(1, shape, 0.012, [1.1])  # 92 tokens/s: drafts that do not pay
    assert c.best(1) == none
    assert c.step_time[(1, none)].value == 0.010
    for _ in range(20):
        c.observe(1, none, 0.010, [1])
    c.observe(1, none, 0.100, [1])  # one spike: clipped to 2x, then weighted 1/10
    assert c.step_time[(1, none)].value == pytest.approx(0.011)
    assert c.best(1) == none


def test_exploration_reaches_the_runner_up_beyond_the_neighbours():
    c = _chooser(explore_every=2)
    for shape, seconds, accept in zip(c.menu, (0.010, 0.020, 0.030, 0.020), (1, 1.0, 1.0, 1.8)):
        c.observe(1, shape, seconds, [accept])  # 100, 50, 33, 90 tokens/s: plain is best, 4 a close second
    picks = [c.choose(1) for _ in range(32)]
    assert c.menu[3] in picks  # not plain decoding's neighbour, but within 80 % of it
    assert c.menu[1] not in picks and c.menu[2] not in picks  # estimated far below: not tried


def test_a_slow_warm_up_step_of_plain_decoding_is_outvoted_by_real_steps():
    """Warm-up timed plain decoding at 58 ms (a slow moment), a small draft at 50 ms: the draft runs,
    plain decoding is still explored, and its real 30 ms steps win it back."""
    c = ShapeChooser(shape_menu(1, 1, 2), batch_buckets=(4,), explore_every=4, min_samples=3)
    plain, draft = c.menu
    c.observe(4, plain, 0.058, [1] * 4, warm_up=True)
    c.observe(4, draft, 0.050, [2] * 4, warm_up=True)
    c.forget_acceptance()
    picks = []
    for _ in range(40):
        picks.append(c.choose(4))
        c.observe(4, picks[-1], 0.030 if not picks[-1].drafts else 0.050, [2, 1, 2, 1] if picks[-1].drafts else [1] * 4)
    assert picks[0] == draft  # 1.5 tokens in 50 ms against 1 in 58
    assert c.step_time[(4, plain)].value == pytest.approx(0.030, rel=0.1)
    assert c.best(4) == plain and picks[-10:].count(plain) >= 9  # 1.5 in 50 ms loses to 1 in 30


def test_neighbours_far_below_the_best_are_not_explored_until_their_acceptance_is_stale():
    """A draft estimated far below plain decoding is not explored, until no step has sampled its
    acceptance for `stale_after` exploration periods (`explore_every` steps each for a drafter without
    catch-up; 4 x `max_backoff` times longer for one with it): then once, and its new sample counts."""
    c = ShapeChooser(shape_menu(3, 1, 4), batch_buckets=(1,), explore_every=1, min_samples=1, drafts_catch_up=False)
    c.observe(1, c.menu[0], 0.010, [1])  # 100 tokens/s
    c.observe(1, c.menu[1], 0.030, [1.2])  # 40: a draft step costs 3x at this batch size
    for shape in c.menu[2:]:
        c.observe(1, shape, 0.030, [1.2])
    fresh = c.stale_after * c.explore_every - 1
    assert {c.choose(1) for _ in range(fresh)} == {c.menu[0]}
    assert not c.stale(c.menu[1])
    assert c.choose(1) == c.menu[1]  # stale now: explored whatever its estimate
    c.observe(1, c.menu[1], 0.012, [3])  # this time it paid: 2.1 tokens in 21 ms on average
    assert not c.stale(c.menu[1])
    assert c.rate(1, c.menu[1]) >= c.explore_within * c.rate(1, c.menu[0])  # explored as a neighbour again
    catching_up = ShapeChooser(shape_menu(3, 1, 4), batch_buckets=(1,), explore_every=1, min_samples=1)
    catching_up.observe(1, catching_up.menu[1], 0.030, [1.2])
    catching_up._step = fresh + 1
    assert not catching_up.stale(catching_up.menu[1])  # 4 x max_backoff periods for a catch-up
    catching_up._step = catching_up.stale_after * 4 * catching_up.max_backoff
    assert catching_up.stale(catching_up.menu[1])


def test_path_chooser_runs_the_faster_path_and_the_other_every_explore_every_steps():
    c = PathChooser(explore_every=8)
    c.seed((1, 1), "compiled", 0.030)
    c.seed((1, 1), "eager", 0.025)
    picks = [c.choose((1, 1)) for _ in range(32)]
    assert picks.count("compiled") == 4 and all(picks[i] == "compiled" for i in (7, 15, 23, 31))


def test_path_chooser_tries_a_far_slower_path_less_often():
    """Eager at 3x the program's time: tried every 3 x explore_every steps, not every explore_every."""
    c = PathChooser(explore_every=8)
    c.seed((1, 1), "compiled", 0.020)
    c.seed((1, 1), "eager", 0.060)
    picks = [c.choose((1, 1)) for _ in range(96)]
    assert picks.count("eager") == 4 and all(picks[i] == "eager" for i in (23, 47, 71, 95))


def test_only_steps_on_the_settled_path_stand_for_a_shapes_time():
    """Exploring forwards (an unmeasured path, or the slower one) are kept out of the shape's step
    time; their acceptance still counts."""
    paths = PathChooser(explore_every=4)
    key = (1, 4)
    assert not paths.settled_on(key, "compiled")  # nothing measured yet
    paths.seed(key, "compiled", 0.020)
    assert not paths.settled_on(key, "compiled")  # eager not measured yet
    paths.seed(key, "eager", 0.060)
    assert paths.settled_on(key, "compiled") and not paths.settled_on(key, "eager")
    assert PathChooser(pinned=True).settled_on(key, "compiled")
    c = _chooser()
    shape = c.menu[-1]
    c.observe(1, shape, None, [3])
    assert c.step_time[(1, shape)].count == 0 and c.accept[shape].count == 1


def test_path_chooser_leaves_a_path_that_turns_slow():
    """A program timed faster at start-up that runs slower in the loop is left after a few steps."""
    c = PathChooser(explore_every=4)
    key = (1, 1)
    c.seed(key, "compiled", 0.020)
    c.seed(key, "eager", 0.025)
    steps = 0
    while c.best(key) == "compiled":
        path = c.choose(key)
        c.observe(key, path, 0.030 if path == "compiled" else 0.025)
        steps += 1
        assert steps < 40
    assert c.best((1, 4)) == "compiled"  # keys are separate; unmeasured paths run first
    c.observe((1, 4), "compiled", 0.01)
    assert c.best((1, 4)) == "compiled"
    for _ in range(3):
        c.observe((1, 4), "compiled", 0.01)
    assert c.best((1, 4)) == "eager"


def test_real_forwards_outvote_a_skewed_start_up_timing():
    """A start-up timing of the program taken while the host was busy (200 ms against eager's 57):
    two real forwards of 11 ms make the program the faster path again."""
    c = PathChooser(explore_every=4)
    key = (1, 1)
    c.seed(key, "compiled", 0.200)
    c.seed(key, "eager", 0.057)
    assert c.best(key) == "eager"
    for _ in range(2):
        c.observe(key, "compiled", 0.011)
    assert c.best(key) == "compiled"


def test_a_pinned_path_chooser_always_runs_the_program():
    c = PathChooser(explore_every=2, pinned=True)
    c.seed((1, 1), "eager", 0.001)
    assert {c.choose((1, 1)) for _ in range(10)} == {"compiled"}


def test_a_shape_timed_only_at_warm_up_is_not_timed_until_a_real_step():
    """`timed` tells the engine whether a step a grammar reshaped may time the shape: not once real steps
    have, but while only its warm-up figure stands (which gets it explored whatever its estimate)."""
    plain, draft = DraftShape(1, 0, 1), DraftShape(4, 3, 1)
    c = ShapeChooser([plain, draft], [1, 8])
    assert not c.timed(8, draft)
    c.observe(8, draft, 0.030, [2], warm_up=True)
    assert c.step_time[(8, draft)].count >= c.min_samples and not c.timed(8, draft)
    c.observe(8, draft, 0.020, [2])
    assert c.timed(8, draft) and c.timed(8, DraftShape(6, 5, 1)), "a shape off the menu counts as timed"


@pytest.mark.parametrize("catches_up", [False, True])
def test_a_warm_up_figure_alone_gets_a_draft_explored_only_where_exploring_costs_no_catch_up(catches_up):
    """A draft whose time is only its warm-up figure is explored whatever its estimate where the drafter
    does not catch up (an exploration costs that step); where it does, every exploration pays a catch-up
    over the skipped tokens of every row, so the shape is explored by its estimate like any other, and a
    draft estimated far below plain decoding is left alone. Plain decoding's warm-up figure is doubted
    either way."""
    plain, draft = DraftShape(1, 0, 1), DraftShape(2, 1, 1)
    c = ShapeChooser([plain, draft], batch_buckets=(8,), explore_every=1, min_samples=1, drafts_catch_up=catches_up)
    c.observe(8, draft, 0.050, [1.1] * 8, warm_up=True)  # a warm-up figure: 22 tokens/s a request
    for _ in range(3):
        c.observe(8, plain, 0.010, [1] * 8)  # real steps: 100 tokens/s a request
    c.observe(8, draft, None, [1.1] * 8)  # acceptance measured, no time beyond the warm-up's
    assert c.step_time[(8, draft)].provisional and c.best(8) == plain
    steps = 8 if not catches_up else c.stale_after * 4 * c.max_backoff // 2  # 16 explorations, none stale yet
    explored = {c.choose(8) for _ in range(steps)}
    assert (draft in explored) is not catches_up
    fresh = ShapeChooser([plain, draft], batch_buckets=(8,), min_samples=1, drafts_catch_up=catches_up)
    for shape in (plain, draft):
        fresh.observe(8, shape, 0.010, [1] * 8, warm_up=True)
    assert fresh._doubted(8, plain) and fresh._doubted(8, draft) is not catches_up
