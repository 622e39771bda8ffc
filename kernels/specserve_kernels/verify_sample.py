"""Lossless tree speculative sampling, target-only (draft probabilities taken as one-hot).

The rule of SGLang's `tree_speculative_sampling_target_only` / EAGLE's `evaluate_posterior`.
With q[i] = the target's (already temperature / top-k / top-p processed) distribution after node i:

    cur = 0, level = 0                        # the root is the last verified token
    loop:
        u = coins[level]; acc = 0
        for c in children(cur), in sibling order:
            acc += q[cur][token(c)]
            if u < acc: accept c; cur = c; level += 1; next loop   # probability q[cur][token(c)]
        stop                                  # no child accepted (or cur is a leaf)
    bonus ~ q[cur] with the tokens of cur's children zeroed, renormalised (inverse CDF, final_coin)

Siblings carry distinct tokens, so a child's token is emitted with exactly its target probability
and any other token v with probability (1 - sum of children's q) * q(v) / (1 - sum of children's q)
= q(v): every emitted token follows the target distribution. If the residual mass is 0 (children
covered every token, and rounding rejected them all) the bonus falls back to argmax q[cur].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve_kernels._launch import check_same_device, check_shape, check_tensor, use_triton
from specserve_kernels.verify_greedy import VerifyResult, check_walk_inputs, empty_result, walk_reference


@triton.jit(do_not_specialize=["N", "stride_draft_b", "stride_fc_b", "stride_ns_b", "stride_probs_b", "stride_coins_b",
                             "stride_final_b", "stride_acc_b"])  # all vary with the tree size N
def _verify_sample_kernel(
    draft_ptr,
    first_child_ptr,
    next_sibling_ptr,
    probs_ptr,
    coins_ptr,
    final_coins_ptr,
    accepted_ptr,
    accept_length_ptr,
    bonus_ptr,
    N,
    V,
    stride_draft_b,
    stride_draft_n,
    stride_fc_b,
    stride_fc_n,
    stride_ns_b,
    stride_ns_n,
    stride_probs_b,
    stride_probs_n,
    stride_probs_v,
    stride_coins_b,
    stride_coins_n,
    stride_final_b,
    stride_acc_b,
    stride_acc_n,
    stride_len_b,
    stride_bonus_b,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per tree: the walk (branch-free, as in the greedy kernel), then the bonus
    sample in two passes over the vocabulary in BLOCK_V chunks (mass, then inverse CDF)."""
    b = tl.program_id(0).to(tl.int64)
    draft_row = draft_ptr + b * stride_draft_b
    fc_row = first_child_ptr + b * stride_fc_b
    ns_row = next_sibling_ptr + b * stride_ns_b
    probs_row = probs_ptr + b * stride_probs_b
    coins_row = coins_ptr + b * stride_coins_b
    slots = tl.arange(0, BLOCK_N)

    # 1. The walk. A step adds the next child's probability to `acc` and accepts it if u < acc.
    accepted = tl.where(slots == 0, 0, -1).to(tl.int64)  # (BLOCK_N,)
    length = tl.full((), 1, tl.int64)
    cur = tl.full((), 0, tl.int64)
    acc = tl.zeros((), dtype=tl.float32)
    u = tl.load(coins_row)
    child = tl.load(fc_row)
    for _ in range(N):
        live = child >= 0
        c = tl.where(live, child, 0)
        token = tl.load(draft_row + c * stride_draft_n)
        q = tl.load(probs_row + cur * stride_probs_n + token * stride_probs_v, mask=live, other=0.0)
        acc += q
        hit = live & (u < acc)
        accepted = tl.where(hit & (slots == length), child, accepted)
        length += hit.to(tl.int64)
        cur = tl.where(hit, child, cur)
        acc = tl.where(hit, 0.0, acc)
        u = tl.load(coins_row + (length - 1) * stride_coins_n)  # a fresh coin per level
        nxt = tl.where(hit, tl.load(fc_row + c * stride_fc_n), tl.load(ns_row + c * stride_ns_n))
        child = tl.where(live, nxt, -1)

    # 2. The tokens of cur's children (all rejected; none if cur is a leaf), -1 padded.
    rejected = tl.full([BLOCK_N], -1, tl.int64)
    child = tl.load(fc_row + cur * stride_fc_n)
    for k in range(N):
        live = child >= 0
        c = tl.where(live, child, 0)
        rejected = tl.where((slots == k) & live, tl.load(draft_row + c * stride_draft_n), rejected)
        child = tl.where(live, tl.load(ns_row + c * stride_ns_n), -1)

    # 3. Residual mass of q[cur] without the rejected tokens; argmax of q[cur] as the fallback.
    q_row = probs_row + cur * stride_probs_n
    vocab = tl.arange(0, BLOCK_V)
    total = tl.zeros((), dtype=tl.float32)
    best_q = tl.full((), -1.0, tl.float32)
    best_v = tl.full((), 0, tl.int64)
    for start in range(0, V, BLOCK_V):
        v = start + vocab
        q = tl.load(q_row + v * stride_probs_v, mask=v < V, other=0.0)  # (BLOCK_V,)
        chunk_best = tl.max(q, axis=0)
        better = chunk_best > best_q  # strict: the first maximum wins, as in torch.argmax
        best_v = tl.where(better, start + tl.argmax(q, axis=0).to(tl.int64), best_v)
        best_q = tl.where(better, chunk_best, best_q)
        is_rejected = tl.max((v[:, None] == rejected[None, :]).to(tl.int32), axis=1) > 0
        total += tl.sum(tl.where(is_rejected, 0.0, q), axis=0)

    # 4. Inverse CDF: the first v with q[v] > 0 and cdf[v] > final_coin * total. Rounding can leave
    # the last cdf value just under the threshold; then take the last v with q[v] > 0.
    threshold = tl.load(final_coins_ptr + b * stride_final_b) * total
    prefix = tl.zeros((), dtype=tl.float32)
    found = tl.full((), -1, tl.int64)
    last_nonzero = tl.full((), -1, tl.int64)
    for start in range(0, V, BLOCK_V):
        v = start + vocab
        q = tl.load(q_row + v * stride_probs_v, mask=v < V, other=0.0)
        is_rejected = tl.max((v[:, None] == rejected[None, :]).to(tl.int32), axis=1) > 0
        q = tl.where(is_rejected, 0.0, q)
        cdf = prefix + tl.cumsum(q, axis=0)
        crossing = tl.min(tl.where((cdf > threshold) & (q > 0), v, V), axis=0).to(tl.int64)
        found = tl.where((found < 0) & (crossing < V), crossing, found)
        last_nonzero = tl.maximum(last_nonzero, tl.max(tl.where(q > 0, v, -1), axis=0).to(tl.int64))
        prefix += tl.sum(q, axis=0)
    bonus = tl.where(found >= 0, found, last_nonzero)
    bonus = tl.where(total > 0, bonus, best_v)

    tl.store(accepted_ptr + b * stride_acc_b + slots * stride_acc_n, accepted, mask=slots < N)
    tl.store(accept_length_ptr + b * stride_len_b, length)
    tl.store(bonus_ptr + b * stride_bonus_b, bonus)


def verify_sample(
    draft_tokens: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_coins: torch.Tensor,
) -> VerifyResult:
    """Accept a draft path by tree speculative sampling, then sample the bonus token.

    Parameters
    ----------
    draft_tokens : torch.Tensor
        Token at each tree node (node 0 = root); siblings must carry distinct tokens.
    first_child, next_sibling : torch.Tensor
        Tree links, -1 = none (see `build_tree`).
    target_probs : torch.Tensor
        The target's sampling distribution after each node (temperature / top-k / top-p already
        applied; each row sums to 1).
    coins : torch.Tensor
        Uniforms in [0, 1); coins[b, k] decides level k of the walk.
    final_coins : torch.Tensor
        Uniforms in [0, 1) for the bonus token's inverse-CDF sample.

    Shape:
        draft_tokens, first_child, next_sibling: (B, N) int64, 1 <= N <= 64
        target_probs: (B, N, V) float32
        coins: (B, N) float32
        final_coins: (B,) float32

    Returns
    -------
    VerifyResult
        CUDA input runs the Triton kernel, CPU input the reference (see `use_triton`).
    """
    bsz, n = check_walk_inputs(draft_tokens, first_child, next_sibling)
    check_tensor("target_probs", target_probs, torch.float32, 3)
    if tuple(target_probs.shape[:2]) != (bsz, n) or target_probs.shape[2] == 0:
        raise ValueError(f"target_probs: expected shape ({bsz}, {n}, V), got {tuple(target_probs.shape)}")
    check_tensor("coins", coins, torch.float32, 2)
    check_shape("coins", coins, (bsz, n))
    check_tensor("final_coins", final_coins, torch.float32, 1)
    check_shape("final_coins", final_coins, (bsz,))
    check_same_device(
        draft_tokens=draft_tokens, target_probs=target_probs, coins=coins, final_coins=final_coins
    )
    if not use_triton(draft_tokens) or bsz == 0:
        return verify_sample_reference(
            draft_tokens, first_child, next_sibling, target_probs, coins, final_coins
        )

    vocab_size = target_probs.shape[2]
    block_n = triton.next_power_of_2(n)
    # The rejected-token test is a (BLOCK_V, BLOCK_N) compare: keep that tile at 8k elements (16k spills on sm_80).
    block_v = max(16, min(triton.next_power_of_2(vocab_size), 8192 // block_n))
    out = empty_result(bsz, n, draft_tokens.device)
    _verify_sample_kernel[(bsz,)](
        draft_tokens,
        first_child,
        next_sibling,
        target_probs,
        coins,
        final_coins,
        out.accepted_nodes,
        out.accept_length,
        out.bonus_tokens,
        n,
        vocab_size,
        *draft_tokens.stride(),
        *first_child.stride(),
        *next_sibling.stride(),
        *target_probs.stride(),
        *coins.stride(),
        *final_coins.stride(),
        *out.accepted_nodes.stride(),
        *out.accept_length.stride(),
        *out.bonus_tokens.stride(),
        BLOCK_N=block_n,
        BLOCK_V=block_v,
        num_warps=4,
    )
    return out


def verify_sample_reference(
    draft_tokens: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_coins: torch.Tensor,
) -> VerifyResult:
    """Plain-PyTorch `verify_sample`: the kernel's walk, vectorised over the batch.

    `target_probs` may be an expanded (stride-0) tensor; it is only indexed, never copied whole.
    """
    bsz, n = draft_tokens.shape
    device = draft_tokens.device
    rows = torch.arange(bsz, device=device)
    acc = torch.zeros(bsz, dtype=torch.float32, device=device)  # the examined siblings' probability so far

    def coin_falls(child: torch.Tensor, cur: torch.Tensor, length: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        nonlocal acc
        acc = acc + torch.where(live, target_probs[rows, cur, draft_tokens[rows, child]], 0.0)
        hit = live & (coins[rows, length - 1] < acc)
        acc = torch.where(hit, 0.0, acc)
        return hit

    accepted, length, cur = walk_reference(first_child, next_sibling, coin_falls)

    # Bonus: q[cur] with the tokens of cur's children (all rejected) zeroed.
    q_cur = target_probs[rows, cur]  # (B, V), a copy
    q = q_cur.clone()
    child = first_child[rows, cur]
    for _ in range(n - 1):
        live = child >= 0
        c = child.clamp(min=0)
        token = draft_tokens[rows, c][:, None]  # (B, 1)
        q.scatter_(1, token, torch.where(live[:, None], 0.0, q.gather(1, token)))
        child = torch.where(live, next_sibling[rows, c], -1)

    total = q.sum(dim=-1)  # (B,)
    cdf = q.cumsum(dim=-1)  # (B, V)
    crossing = (cdf > (final_coins * total)[:, None]) & (q > 0)  # (B, V)
    vocab = torch.arange(q.shape[-1], device=device)
    last_nonzero = torch.where(q > 0, vocab, -1).max(dim=-1).values
    bonus = torch.where(crossing.any(dim=-1), crossing.int().argmax(dim=-1), last_nonzero)
    bonus = torch.where(total > 0, bonus, q_cur.argmax(dim=-1))
    return VerifyResult(accepted, length, bonus)
