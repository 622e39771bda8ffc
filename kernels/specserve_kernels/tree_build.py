"""Build a batch of draft trees' depth, attention mask and sibling links from their parents.

The batched, on-device twin of `specserve.tree.DraftTree.from_parents` (same layout: flat trees,
root first, every parent before its children). A row of `parents` (B = 1 shown):

    node:     0     1     2     3     4     5
    parent:  -1     0     0     1     1    -1      node 5 is padding (parent -1 after the root)
    depth:    0     1     1     2     2     0
    mask row 3 = [1, 1, 0, 1, 0, 0]                 3 sees itself and its ancestors 1, 0
    first_child:   1     3    -1    -1    -1    -1
    next_sibling: -1     2    -1     4    -1    -1  siblings are linked in index order

Padding nodes get depth 0, see only themselves, and are linked to nothing. Parent values are not
checked (that would need a host sync): each must be -1, or lie in [0, i) for node i > 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specserve_kernels._launch import check_num_nodes, check_tensor, use_triton


@dataclass(frozen=True)
class TreeTensors:
    """What verification and the tree-attention mask need, for B trees of N nodes.

    Shape:
        depth: (B, N) int64, 0 for the root and for padding
        mask: (B, N, N) bool, mask[b, i, j] iff j == i or j is an ancestor of i
        first_child: (B, N) int64, -1 = none
        next_sibling: (B, N) int64, -1 = none
    """

    depth: torch.Tensor
    mask: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor


@triton.jit(do_not_specialize=["N", "stride_par_b", "stride_depth_b", "stride_mask_b", "stride_mask_i", "stride_fc_b",
                             "stride_ns_b"])  # all vary with the tree size N
def _build_tree_kernel(
    parents_ptr,
    depth_ptr,
    mask_ptr,  # bool mask viewed as uint8
    first_child_ptr,
    next_sibling_ptr,
    N,
    stride_par_b,
    stride_par_n,
    stride_depth_b,
    stride_depth_n,
    stride_mask_b,
    stride_mask_i,
    stride_mask_j,
    stride_fc_b,
    stride_fc_n,
    stride_ns_b,
    stride_ns_n,
    BLOCK_N: tl.constexpr,
):
    """One program per tree; the whole (N, N) mask lives in registers."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)  # the node a row describes
    j = tl.arange(0, BLOCK_N)  # the node a column points at
    par = tl.load(parents_ptr + b * stride_par_b + i * stride_par_n, mask=i < N, other=-1)  # (BLOCK_N,)

    # Links, all nodes at once. first_child[i]: smallest j whose parent is i.
    # next_sibling[i]: smallest j > i with the same (real) parent.
    is_child = (par[None, :] == i[:, None]) & (j[None, :] < N)  # (i, j): j is a child of i
    first = tl.min(tl.where(is_child, j[None, :], BLOCK_N), axis=1)
    later_sibling = (par[None, :] == par[:, None]) & (par[:, None] >= 0) & (j[None, :] > i[:, None])
    later_sibling = later_sibling & (j[None, :] < N)
    sibling = tl.min(tl.where(later_sibling, j[None, :], BLOCK_N), axis=1)

    # Depth and mask, node by node: parents come before children, so row p is final when node i
    # copies it. Padding (parent -1) copies nothing and keeps depth 0 and its own diagonal bit.
    depth = tl.zeros([BLOCK_N], dtype=tl.int64)
    anc = (i[:, None] == j[None, :]).to(tl.int32)  # (BLOCK_N, BLOCK_N): row i = i and its ancestors
    for node in range(1, N):
        p = tl.load(parents_ptr + b * stride_par_b + node * stride_par_n)
        is_p = i == p  # all False for padding
        depth_p = tl.sum(tl.where(is_p, depth, 0))
        row_p = tl.max(tl.where(is_p[:, None], anc, 0), axis=0)  # (BLOCK_N,) over j
        depth = tl.where((i == node) & (p >= 0), depth_p + 1, depth)
        anc = tl.where((i == node)[:, None], tl.maximum(row_p[None, :], anc), anc)

    row_ok = i < N
    tl.store(depth_ptr + b * stride_depth_b + i * stride_depth_n, depth, mask=row_ok)
    tl.store(
        first_child_ptr + b * stride_fc_b + i * stride_fc_n,
        tl.where(first < BLOCK_N, first, -1).to(tl.int64),
        mask=row_ok,
    )
    tl.store(
        next_sibling_ptr + b * stride_ns_b + i * stride_ns_n,
        tl.where(sibling < BLOCK_N, sibling, -1).to(tl.int64),
        mask=row_ok,
    )
    mask_offs = b * stride_mask_b + i[:, None] * stride_mask_i + j[None, :] * stride_mask_j
    tl.store(mask_ptr + mask_offs, anc.to(tl.uint8), mask=row_ok[:, None] & (j[None, :] < N))


def build_tree(parents: torch.Tensor) -> TreeTensors:
    """Depth, ancestor mask and sibling links of B flat trees.

    Parameters
    ----------
    parents : torch.Tensor
        Parent of each node; -1 for the root (node 0) and for padding nodes.

    Shape:
        parents: (B, N) int64, 1 <= N <= 64

    Returns
    -------
    TreeTensors
        CUDA input runs the Triton kernel, CPU input the reference (see `use_triton`).
    """
    check_tensor("parents", parents, torch.int64, 2)
    check_num_nodes("parents", parents.shape[1])
    if not use_triton(parents) and not torch.compiler.is_compiling():
        # the reference, called as it is: a custom op's first call imports torch's compiler stack
        # (seconds of a CPU server's start), and eager CPU code has nothing to trace or capture
        return build_tree_reference(parents)
    return TreeTensors(*torch.ops.specserve.build_tree(parents))


@torch.library.custom_op("specserve::build_tree", mutates_args=())
def _build_tree_op(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One op to tracing and the capture check (a shape-only fake below); the kernel or the reference."""
    bsz, n = parents.shape
    if not use_triton(parents) or bsz == 0:
        t = build_tree_reference(parents)
        return t.depth, t.mask, t.first_child, t.next_sibling

    device = parents.device
    depth = torch.empty(bsz, n, dtype=torch.int64, device=device)
    mask = torch.empty(bsz, n, n, dtype=torch.bool, device=device)
    first_child = torch.empty(bsz, n, dtype=torch.int64, device=device)
    next_sibling = torch.empty(bsz, n, dtype=torch.int64, device=device)
    mask_u8 = mask.view(torch.uint8)
    _build_tree_kernel[(bsz,)](
        parents,
        depth,
        mask_u8,
        first_child,
        next_sibling,
        n,
        *parents.stride(),
        *depth.stride(),
        *mask_u8.stride(),
        *first_child.stride(),
        *next_sibling.stride(),
        BLOCK_N=triton.next_power_of_2(n),
    )
    return depth, mask, first_child, next_sibling


@_build_tree_op.register_fake
def _(parents):  # noqa: ANN001, ANN202
    bsz, n = parents.shape
    return (parents.new_empty(bsz, n), parents.new_empty(bsz, n, n, dtype=torch.bool), parents.new_empty(bsz, n),
            parents.new_empty(bsz, n))


def _first_true(x: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last dim, -1 where there is none."""
    n = x.shape[-1]
    idx = torch.arange(n, device=x.device).expand_as(x)
    first = torch.where(x, idx, n).min(dim=-1).values
    return torch.where(first < n, first, -1)


def build_tree_reference(parents: torch.Tensor) -> TreeTensors:
    """Plain-PyTorch `build_tree`, vectorised over batch and nodes: the ancestor mask by repeated
    squaring of the parent relation (paths of up to 2^k edges after k squarings), so its op count
    grows with log2(N), not N."""
    bsz, n = parents.shape
    device = parents.device
    node = torch.arange(n, device=device)
    is_child = parents[:, None, :] == node[None, :, None]  # (B, i, j): j is a child of i
    # (B, i, j): j is i or an ancestor of i (as 0 / 1 floats, clamped after each product)
    reach = (is_child.transpose(1, 2) | torch.eye(n, dtype=torch.bool, device=device)).float()
    for _ in range(max(n - 2, 0).bit_length()):  # the deepest node is N - 1 edges below the root
        reach = (reach @ reach).clamp(max=1.0)
    mask = reach > 0
    depth = mask.sum(-1) - 1
    later = node[None, None, :] > node[None, :, None]  # (1, i, j): j comes after i
    is_later_sibling = (parents[:, None, :] == parents[:, :, None]) & (parents[:, :, None] >= 0) & later
    return TreeTensors(depth, mask, _first_true(is_child), _first_true(is_later_sibling))
