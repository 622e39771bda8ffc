"""What a training step is made of besides the heads, the same for `train-drafter` and
`train-drafters`: the draft vocabulary the labels range over, the batches (rows of similar length
in a seeded order, padded into tensors with the mask of the positions that count) and the
learning-rate schedule. It runs no model and reads no files.

A row is a `Sample`: its token ids and which of them are answer tokens, either as a mask per id
(`train-drafter`'s conversations, with several answers each) or as the prompt's length
(`train-drafters`' corpus rows: the answer is `ids[prompt length:]`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import torch

Sample = tuple[Sequence[int] | np.ndarray, Sequence[bool] | int]  # (ids, answer mask per id or prompt length)


def answer_mask(sample: Sample) -> np.ndarray:
    """Per id of the row: whether it is an answer token."""
    ids, answer = sample
    if isinstance(answer, (int, np.integer)):
        return np.arange(len(ids)) >= answer
    return np.asarray(answer, dtype=bool)


def draft_vocabulary(samples: Sequence[Sample], size: int, always: tuple[int, ...],
                     vocab_size: int | None = None) -> torch.Tensor:
    """The `size` most frequent answer tokens (plus `always`, which come first), sorted ascending.

    vocab_size None: only tokens some answer holds, equal counts ranked by first appearance (a
    small vocabulary may come out smaller than `size`). vocab_size given: every id below it may be
    chosen (ids at or above it are not counted), equal counts ranked by id, so `size` ids come out.
    """
    answers = [np.asarray(ids, dtype=np.int64)[answer_mask((ids, a))] for ids, a in samples]
    tokens = np.concatenate(answers) if answers else np.zeros(0, dtype=np.int64)
    forced = np.asarray(sorted(set(always))[:size], dtype=np.int64)
    if vocab_size is None:
        seen, first, counts = np.unique(tokens, return_index=True, return_counts=True)
        order = np.argsort(first, kind="stable")
        candidates, counts = seen[order], counts[order]
    else:
        candidates = np.arange(vocab_size, dtype=np.int64)
        counts = np.bincount(tokens[tokens < vocab_size], minlength=vocab_size)
    free = ~np.isin(candidates, forced)
    frequent = candidates[free][np.argsort(-counts[free], kind="stable")][: size - len(forced)]
    return torch.from_numpy(np.sort(np.concatenate([forced, frequent]))).to(torch.int64)


def batches(samples: Sequence[Sample], max_rows: int, seed: int, batch_tokens: int = 0) -> list[list[int]]:
    """Row indices in batches of similar length (less padding), in a seeded random order: at most
    `max_rows` rows, and with `batch_tokens` at most that many rows x longest row (0 = no bound)."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i][0]))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        full = len(cur) == max_rows or bool(batch_tokens) and (len(cur) + 1) * len(samples[i][0]) > batch_tokens
        if cur and full:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    random.Random(seed).shuffle(out)
    return out


def padded(samples: Sequence[Sample], rows: list[int], device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """rows -> (tokens (B, T) zero-padded, loss mask (B, T): position j counts when token j+1 is an
    answer token)."""
    t = max(len(samples[i][0]) for i in rows)
    tokens = np.zeros((len(rows), t), dtype=np.int64)
    mask = np.zeros((len(rows), t), dtype=bool)
    for r, i in enumerate(rows):
        ids = samples[i][0]
        tokens[r, : len(ids)] = ids
        mask[r, : len(ids) - 1] = answer_mask(samples[i])[1:]
    return torch.from_numpy(tokens).to(device), torch.from_numpy(mask).to(device)


def learning_rate(peak: float, step: int, progress: float, warmup_steps: int, warmup_share: float = 0.0) -> float:
    """Linear warm-up over `warmup_steps` (or, with `warmup_share`, over that share of the run's
    progress if it ends first), then cosine decay to 5 % of `peak` as progress goes from 0 to 1."""
    warm = min(1.0, max((step + 1) / warmup_steps, progress / warmup_share if warmup_share else 0.0))
    return peak * warm * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
