"""Turn target logits into what verification consumes: argmax tokens (greedy) or probabilities.

The same processing applies at every tree node and in plain decoding, so speculative and plain
decoding see the same target distribution (the lossless guarantee rests on that).
This module draws no random numbers: verification gets uniforms from `draw_uniforms`.
"""

from __future__ import annotations

import torch

from specserve.config import SamplingParams


def suppress_eos(logits: torch.Tensor, depth: torch.Tensor, eos_ids: tuple[int, ...], tokens_short: int) -> None:
    """In place: forbid EOS at nodes that would emit an output token before `min_tokens` is reached.

    logits: (N, V); depth: (N,) node depths (node at depth d emits output token number produced + d).
    tokens_short: min_tokens - produced.
    """
    if tokens_short <= 0 or not eos_ids:
        return
    rows = depth < tokens_short
    logits[rows.nonzero(), list(eos_ids)] = float("-inf")


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(N, V) logits -> (N, V) float32 probabilities after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always the first token)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw_uniforms(n: int, generator: torch.Generator | None) -> torch.Tensor:
    """(n,) float32 uniforms in [0, 1) from a request's own generator (seeded requests repeat)."""
    return torch.rand(n, generator=generator, dtype=torch.float32)
