"""PrefillBudget: prompt tokens a step computes, from the configured limit and measured step times."""

from __future__ import annotations

import pytest

from specserve.engine.prefill_budget import MIN_CHUNK, PrefillBudget


def test_the_configured_limit_holds_until_both_times_are_known():
    budget = PrefillBudget(limit=512)
    assert budget.tokens(decoding=True, unlimited=4096) == 512
    budget.observe(0.030, prompt_tokens=0, decoding=True)
    assert budget.decode_s == pytest.approx(0.030) and budget.tokens(decoding=True, unlimited=4096) == 512


def test_beside_decoding_a_step_adds_at_most_stall_decode_steps_of_prompt_work():
    budget = PrefillBudget(limit=512, stall=3.0)
    budget.observe(0.030, prompt_tokens=0, decoding=True)  # a decode step: 30 ms
    budget.observe(0.030 + 0.256, prompt_tokens=512, decoding=True)  # 512 tokens beside it: 0.5 ms each
    assert budget.prompt.slope == pytest.approx(0.0005)
    assert budget.tokens(decoding=True, unlimited=4096) == 180  # 3 x 30 ms / 0.5 ms
    assert budget.tokens(decoding=False, unlimited=4096) == 512  # alone: the whole limit


def test_a_prompt_only_step_measures_the_token_cost_and_zero_means_whole_prompts():
    budget = PrefillBudget(limit=0)
    budget.observe(0.5, prompt_tokens=1000, decoding=False)
    assert budget.prompt.slope == pytest.approx(0.0005)
    assert budget.tokens(decoding=False, unlimited=4096) == 4096
    budget.observe(0.01, prompt_tokens=0, decoding=True)
    assert budget.tokens(decoding=True, unlimited=4096) == 60


def test_estimates_follow_the_machine_and_a_prompt_always_progresses():
    budget = PrefillBudget(limit=512, horizon=2)
    budget.observe(0.010, prompt_tokens=0, decoding=True)
    budget.observe(0.030, prompt_tokens=0, decoding=True)  # the machine slowed down
    assert budget.decode_s == pytest.approx(0.020)
    budget.observe(0.050, prompt_tokens=0, decoding=True)  # past the horizon: a moving average
    assert budget.decode_s == pytest.approx(0.035)
    budget.observe(0.035 + 10.0, prompt_tokens=100, decoding=True)  # a stall: 0.1 s a token
    assert budget.tokens(decoding=True, unlimited=4096) == MIN_CHUNK
    small = PrefillBudget(limit=7)
    small.observe(0.01, prompt_tokens=0, decoding=True)
    small.observe(1.0, prompt_tokens=1, decoding=False)
    assert small.tokens(decoding=True, unlimited=64) == 7


def test_a_fixed_cost_per_forward_does_not_shrink_the_chunks_to_the_floor():
    """Prompt work costs 30 ms a forward plus 0.4 ms a token (an eager forward on 2 cores), a decode
    step 35 ms: the chunk that costs three decode steps is (105 - 30) / 0.4 = 187 tokens. Priced per
    token alone, the streams' 30-token prompts (1.4 ms a token) would make it 75."""
    budget = PrefillBudget(limit=512)
    cost = lambda n: 0.030 + 0.0004 * n  # noqa: E731
    for n in (30, 30, 30, 30):  # the streams' own prompts, nothing decoding yet
        budget.observe(cost(n), prompt_tokens=n, decoding=False)
    budget.observe(0.035, prompt_tokens=0, decoding=True)
    assert budget.tokens(decoding=True, unlimited=4096) == 75  # one size seen: per token alone
    for _ in range(3):  # a long prompt beside the streams
        n = budget.tokens(decoding=True, unlimited=4096)
        budget.observe(0.035 + cost(n), prompt_tokens=n, decoding=True)
    assert budget.prompt.intercept == pytest.approx(0.030) and budget.prompt.slope == pytest.approx(0.0004)
    assert budget.tokens(decoding=True, unlimited=4096) == 187
