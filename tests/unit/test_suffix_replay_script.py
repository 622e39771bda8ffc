"""bench/suffix_replay.py: the replay of greedy outputs through suffix decoding, on synthetic token streams (no
model): plain decoding's budget accepts one token a step, and a request that repeats an earlier one's text is
drafted from the shared store."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from specserve.config import SpecConfig

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def replay_module(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its sibling ngram_replay
    spec = importlib.util.spec_from_file_location("suffix_replay", BENCH / "suffix_replay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _example(seed: int) -> tuple[list[int], list[int]]:
    prompt = [1000 + seed, 7, 8, 9]
    output = [(seed * 31 + 17 * i) % 500 + 10 for i in range(40)]
    return prompt, output


def test_plain_budget_accepts_one_token_a_step_and_a_repeat_is_drafted(replay_module):
    first, other = _example(1), _example(2)
    stream = [first, other, first]  # the third request's text was served before
    totals = replay_module.replay(stream, SpecConfig(algorithm="suffix"), [1, 8], costs=None)
    outputs = sum(len(o) - 1 for _, o in stream)  # each output's first token comes from the prefill
    assert totals["1"] == {"tokens": outputs, "steps": outputs, "drafting": 0, "ms": float(outputs)}
    alone = replay_module.replay([first], SpecConfig(algorithm="suffix"), [8], costs=None)["8"]
    assert alone["steps"] == len(first[1]) - 1 and alone["drafting"] == 0  # nothing repeats: nothing drafted
    drafted = totals["8"]
    assert drafted["tokens"] == outputs
    # the repeat takes far fewer steps than its tokens: the shared store holds its continuation
    assert drafted["steps"] < outputs - (len(first[1]) - 1) // 2
    assert drafted["drafting"] > 0


def test_the_drafters_own_sizes_draft_the_repeat_and_pay(replay_module):
    first, other = _example(1), _example(2)
    stream = [first, other, first]
    outputs = sum(len(o) - 1 for _, o in stream)
    costs = lambda n: 1.0 + 0.1 * (n - 1)  # noqa: E731  ms: a verified node costs a tenth of a step
    totals = replay_module.replay(stream, SpecConfig(algorithm="suffix"), [1, 8], costs, overhead_ms=0.5)
    plain, sized = totals["1"], totals["sized"]
    assert plain["ms"] == pytest.approx(1.5 * outputs)  # every step pays the overhead beside its forward
    assert sized["tokens"] == outputs and 0 < sized["drafting"] < sized["steps"] < outputs
    assert sized["tokens"] / sized["ms"] > 1.2 * plain["tokens"] / plain["ms"]


def test_the_oracle_drafts_the_repeat_in_fewer_steps_than_any_tree(replay_module):
    first, other = _example(1), _example(2)
    stream = [first, other, first]
    outputs = sum(len(o) - 1 for _, o in stream)
    totals = replay_module.replay(stream, SpecConfig(algorithm="suffix"), [1, 8], costs=None)
    oracle = totals["oracle"]
    assert oracle["tokens"] == outputs and 0 < oracle["drafting"] < oracle["steps"]
    assert oracle["steps"] <= totals["8"]["steps"]
    # alone, nothing repeats: the oracle has nothing to draft either
    alone = replay_module.replay([first], SpecConfig(algorithm="suffix"), [8], costs=None)["oracle"]
    assert alone["steps"] == len(first[1]) - 1 and alone["drafting"] == 0
