"""The training step's pieces both trainers share (`training.steps`): the draft vocabulary, the
batches, the padded rows and the learning-rate schedule, for rows that mark their answers with a
mask per token (train-drafter) or with the prompt's length (train-drafters)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.training.steps import batches, draft_vocabulary, learning_rate, padded
from specserve.training.train_drafter import TrainConfig, progress
from specserve.training.train_heads import WARMUP_SHARE


def test_draft_vocabulary_is_most_frequent_assistant_tokens():
    samples = [([5, 5, 5, 7, 9], [True, True, True, True, False]), ([7, 11], [True, True])]
    assert draft_vocabulary(samples, 2, always=(2,)).tolist() == [2, 5]  # 2 forced, then 5 (3x) over 7 (2x)
    assert draft_vocabulary(samples, 3, always=()).tolist() == [5, 7, 11]


def test_draft_vocabulary_counts_answer_tokens_only():
    samples = [(np.array([9, 9, 9, 5, 5, 7]), 3), (np.array([7, 4]), 1)]
    assert draft_vocabulary(samples, 2, vocab_size=10, always=(2,)).tolist() == [2, 5]  # 9s are prompt tokens
    assert draft_vocabulary(samples, 3, vocab_size=10, always=()).tolist() == [4, 5, 7]


def test_draft_vocabulary_ranks_ties_by_first_appearance_or_by_id():
    samples = [([8, 3, 6], [True, True, True])]
    assert draft_vocabulary(samples, 2, always=()).tolist() == [3, 8]  # 8 and 3 came first
    assert draft_vocabulary(samples, 2, always=(), vocab_size=10).tolist() == [3, 6]  # the lowest ids
    assert draft_vocabulary(samples, 5, always=()).tolist() == [3, 6, 8]  # only tokens the answers hold
    assert draft_vocabulary(samples, 5, always=(), vocab_size=10).tolist() == [0, 1, 3, 6, 8]


def test_batches_cover_every_row_once_within_the_token_budget():
    samples = [(np.arange(n), 1) for n in (3, 9, 4, 8, 2, 7)]
    plan = batches(samples, max_rows=3, seed=0, batch_tokens=16)
    assert sorted(i for b in plan for i in b) == list(range(6))
    assert all(len(b) * max(len(samples[i][0]) for i in b) <= 16 and len(b) <= 3 for b in plan)
    tokens, mask = padded(samples, [0, 1], "cpu")
    assert tokens.shape == (2, 9) and mask[0].tolist() == [True, True] + [False] * 7  # predicts tokens 1, 2
    assert torch.equal(tokens[1], torch.arange(9))


def test_without_a_token_budget_batches_are_runs_of_max_rows_by_length():
    samples = [(list(range(n)), [True] * n) for n in (3, 9, 4, 8, 2, 7, 5)]
    plan = batches(samples, max_rows=3, seed=1)
    assert sorted(map(sorted, plan)) == [[0, 2, 4], [1], [3, 5, 6]]  # by length: 2 3 4 | 5 7 8 | 9


def test_a_mask_and_a_prompt_length_mark_the_same_answer_alike():
    ids = [4, 1, 6, 2, 9]
    by_mask, by_length = [(ids, [False, False, True, True, True])], [(np.array(ids), 2)]
    for a, b in zip(padded(by_mask, [0], "cpu"), padded(by_length, [0], "cpu")):
        assert torch.equal(a, b)
    assert padded(by_length, [0], "cpu")[1].tolist() == [[False, True, True, True, False]]  # predicts 6, 2, 9
    assert draft_vocabulary(by_mask, 2, always=()).tolist() == draft_vocabulary(by_length, 2, always=()).tolist()


def test_learning_rate_warms_up_and_decays_by_steps_or_time():
    tc = TrainConfig(algorithm="eagle3", model_dir="m", out_dir="o", lr=1.0, warmup_steps=10, max_minutes=10)
    assert learning_rate(tc.lr, 0, progress(tc, 0, 100, 0), tc.warmup_steps) == pytest.approx(0.1)
    assert learning_rate(tc.lr, 50, progress(tc, 50, 100, 0), tc.warmup_steps) == pytest.approx(0.525)
    assert learning_rate(tc.lr, 50, progress(tc, 50, 100, 600), tc.warmup_steps) == pytest.approx(0.05)  # the floor


def test_a_warmup_share_ends_the_warmup_early_in_a_short_run():
    assert (learning_rate(1.0, 0, 0.05, warmup_steps=50)
            == pytest.approx(0.02 * (0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * 0.05)))))
    assert (learning_rate(1.0, 0, 0.05, 50, WARMUP_SHARE)
            == pytest.approx(0.5 * (0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * 0.05)))))
