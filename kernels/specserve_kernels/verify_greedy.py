"""Greedy tree verification: keep the longest path of drafts that match the target's argmax.

Per request, with `target_tokens[i]` = the target's argmax after the prefix ending at node i:

    cur = 0                                   # the root is the last verified token: always accepted
    loop:
        c = the first child of cur (in sibling order) with draft_tokens[c] == target_tokens[cur]
        if none: stop
        accept c; cur = c
    bonus = target_tokens[cur]                # the target's own next token after the accepted path

The step emits draft_tokens[accepted_nodes[1:]] followed by the bonus token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specserve_kernels._launch import (
    check_num_nodes,
    check_same_device,
    check_shape,
    check_tensor,
    use_triton,
)


@dataclass(frozen=True)
class VerifyResult:
    """The accepted path of each of B trees of N nodes, and the token that follows it.

    Shape:
        accepted_nodes: (B, N) int64, [0, c1, c2, ...] (strictly increasing) then -1s
        accept_length: (B,) int64, number of accepted nodes, root included (accepted drafts + 1)
        bonus_tokens: (B,) int64, the token emitted after the accepted drafts
    """

    accepted_nodes: torch.Tensor
    accept_length: torch.Tensor
    bonus_tokens: torch.Tensor


def check_walk_inputs(
    draft_tokens: torch.Tensor, first_child: torch.Tensor, next_sibling: torch.Tensor
) -> tuple[int, int]:
    """Checks shared by the verify launchers; returns (B, N)."""
    check_tensor("draft_tokens", draft_tokens, torch.int64, 2)
    shape = tuple(draft_tokens.shape)
    check_num_nodes("draft_tokens", shape[1])
    for name, t in (("first_child", first_child), ("next_sibling", next_sibling)):
        check_tensor(name, t, torch.int64, 2)
        check_shape(name, t, shape)
    check_same_device(draft_tokens=draft_tokens, first_child=first_child, next_sibling=next_sibling)
    return shape


def empty_result(bsz: int, n: int, device: torch.device) -> VerifyResult:
    return VerifyResult(
        accepted_nodes=torch.empty(bsz, n, dtype=torch.int64, device=device),
        accept_length=torch.empty(bsz, dtype=torch.int64, device=device),
        bonus_tokens=torch.empty(bsz, dtype=torch.int64, device=device),
    )


@triton.jit(do_not_specialize=["N", "stride_draft_b", "stride_fc_b", "stride_ns_b", "stride_target_b",
                             "stride_acc_b"])  # all vary with the tree size N
def _verify_greedy_kernel(
    draft_ptr,
    first_child_ptr,
    next_sibling_ptr,
    target_ptr,
    accepted_ptr,
    accept_length_ptr,
    bonus_ptr,
    N,
    stride_draft_b,
    stride_draft_n,
    stride_fc_b,
    stride_fc_n,
    stride_ns_b,
    stride_ns_n,
    stride_target_b,
    stride_target_n,
    stride_acc_b,
    stride_acc_n,
    stride_len_b,
    stride_bonus_b,
    BLOCK_N: tl.constexpr,
):
    """One program per tree. The walk is branch-free: a step either rejects `child` (moves to its
    next sibling) or accepts it (descends to its first child), so each node is examined at most
    once and N steps always finish; finished walks keep stepping with child = -1 as no-ops."""
    b = tl.program_id(0).to(tl.int64)
    draft_row = draft_ptr + b * stride_draft_b
    fc_row = first_child_ptr + b * stride_fc_b
    ns_row = next_sibling_ptr + b * stride_ns_b
    target_row = target_ptr + b * stride_target_b
    slots = tl.arange(0, BLOCK_N)

    accepted = tl.where(slots == 0, 0, -1).to(tl.int64)  # (BLOCK_N,) the path, in registers
    length = tl.full((), 1, tl.int64)
    cur = tl.full((), 0, tl.int64)
    want = tl.load(target_row)  # the target's token after the root
    child = tl.load(fc_row)
    for _ in range(N):
        live = child >= 0
        c = tl.where(live, child, 0)
        hit = live & (tl.load(draft_row + c * stride_draft_n) == want)
        accepted = tl.where(hit & (slots == length), child, accepted)
        length += hit.to(tl.int64)
        cur = tl.where(hit, child, cur)
        want = tl.load(target_row + cur * stride_target_n)
        nxt = tl.where(hit, tl.load(fc_row + c * stride_fc_n), tl.load(ns_row + c * stride_ns_n))
        child = tl.where(live, nxt, -1)

    tl.store(accepted_ptr + b * stride_acc_b + slots * stride_acc_n, accepted, mask=slots < N)
    tl.store(accept_length_ptr + b * stride_len_b, length)
    tl.store(bonus_ptr + b * stride_bonus_b, want)


def verify_greedy(
    draft_tokens: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    target_tokens: torch.Tensor,
) -> VerifyResult:
    """Accept the longest draft path that the target's greedy choices agree with.

    Parameters
    ----------
    draft_tokens : torch.Tensor
        Token at each tree node (node 0 = root); siblings are tried in `next_sibling` order.
    first_child, next_sibling : torch.Tensor
        Tree links, -1 = none (see `build_tree`).
    target_tokens : torch.Tensor
        The target model's argmax token after each node.

    Shape:
        draft_tokens, first_child, next_sibling, target_tokens: (B, N) int64, 1 <= N <= 64

    Returns
    -------
    VerifyResult
        CUDA input runs the Triton kernel, CPU input `verify_greedy_host`, any other (the meta
        device's) the reference (see `use_triton`).
    """
    bsz, n = check_walk_inputs(draft_tokens, first_child, next_sibling)
    check_tensor("target_tokens", target_tokens, torch.int64, 2)
    check_shape("target_tokens", target_tokens, (bsz, n))
    check_same_device(draft_tokens=draft_tokens, target_tokens=target_tokens)
    if not use_triton(draft_tokens) or bsz == 0:
        walk = verify_greedy_host if draft_tokens.device.type == "cpu" else verify_greedy_reference
        return walk(draft_tokens, first_child, next_sibling, target_tokens)

    out = empty_result(bsz, n, draft_tokens.device)
    _verify_greedy_kernel[(bsz,)](
        draft_tokens,
        first_child,
        next_sibling,
        target_tokens,
        out.accepted_nodes,
        out.accept_length,
        out.bonus_tokens,
        n,
        *draft_tokens.stride(),
        *first_child.stride(),
        *next_sibling.stride(),
        *target_tokens.stride(),
        *out.accepted_nodes.stride(),
        *out.accept_length.stride(),
        *out.bonus_tokens.stride(),
        BLOCK_N=triton.next_power_of_2(n),
        num_warps=1,
    )
    return out


def walk_reference(
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    accepts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verify kernels' tree walk in plain PyTorch, vectorised over the batch (their references).

    From the root, the children of the current node are examined in sibling order; the first one
    `accepts(child, cur, length, live)` accepts becomes the current node, and the walk goes on
    below it. `child` (B,) is the examined node of each row (clamped to 0 where the row has none,
    `live` False), `cur` (B,) the current node, `length` (B,) the accepted nodes so far; it returns
    (B,) bool, and is called once per examined node in walk order (it may keep state).
    Returns accepted_nodes (B, N) (root first, then -1s), accept_length (B,), the last accepted node (B,).
    """
    bsz, n = first_child.shape
    device = first_child.device
    rows = torch.arange(bsz, device=device)
    accepted = torch.full((bsz, n), -1, dtype=torch.int64, device=device)
    accepted[:, 0] = 0
    length = torch.ones(bsz, dtype=torch.int64, device=device)
    cur = torch.zeros(bsz, dtype=torch.int64, device=device)
    child = first_child[:, 0].clone()
    for _ in range(n - 1):  # each non-root node is examined at most once
        live = child >= 0
        c = child.clamp(min=0)
        hit = live & accepts(c, cur, length, live)
        at = length.clamp(max=n - 1)[:, None]  # (B, 1): the next path entry (a hit row has one left)
        accepted.scatter_(1, at, torch.where(hit[:, None], child[:, None], accepted.gather(1, at)))
        length += hit.long()
        cur = torch.where(hit, child, cur)
        child = torch.where(hit, first_child[rows, c], torch.where(live, next_sibling[rows, c], -1))
    return accepted, length, cur


def verify_greedy_host(
    draft_tokens: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    target_tokens: torch.Tensor,
) -> VerifyResult:
    """`verify_greedy` on CPU tensors: `greedy_walk` over the rows as lists. A tree has at most `MAX_NODES`
    nodes, so the walk is a few list reads; the vectorised reference pays torch's per-op cost about ten
    times per examined node (a 4-node chain: about 110 us against 15 us here)."""
    bsz, n = draft_tokens.shape
    accepted, lengths, bonus = greedy_walk(*(x.tolist() for x in (draft_tokens, first_child, next_sibling,
                                                                   target_tokens)))
    return VerifyResult(torch.tensor(accepted, dtype=torch.int64).reshape(bsz, n),
                        torch.tensor(lengths, dtype=torch.int64), torch.tensor(bonus, dtype=torch.int64))


def greedy_walk(drafts: list[list[int]], firsts: list[list[int]], siblings: list[list[int]],
                targets: list[list[int]]) -> tuple[list[list[int]], list[int], list[int]]:
    """The kernel's walk on host lists, (B, N) each: per row its accepted nodes (-1 padded to N), accept
    length and bonus token, as `verify_greedy` returns them."""
    accepted, lengths, bonus = [], [], []
    for draft, first, sibling, target in zip(drafts, firsts, siblings, targets):
        n = len(draft)
        row = [-1] * n
        row[0] = cur = 0
        length, child = 1, first[0]
        for _ in range(n - 1):  # each non-root node is examined at most once
            if child < 0:
                break
            if draft[child] == target[cur]:
                row[length] = cur = child
                length += 1
                child = first[child]
            else:
                child = sibling[child]
        accepted.append(row)
        lengths.append(length)
        bonus.append(target[cur])
    return accepted, lengths, bonus


def verify_greedy_reference(
    draft_tokens: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    target_tokens: torch.Tensor,
) -> VerifyResult:
    """Plain-PyTorch `verify_greedy`: the kernel's walk, vectorised over the batch."""
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)

    def matches(child: torch.Tensor, cur: torch.Tensor, length: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        return draft_tokens[rows, child] == target_tokens[rows, cur]

    accepted, length, cur = walk_reference(first_child, next_sibling, matches)
    return VerifyResult(accepted, length, target_tokens[rows, cur])
