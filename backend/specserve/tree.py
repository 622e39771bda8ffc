"""Draft trees: one request's proposal, a batch of them padded for one verify forward, and a step's
tree shape (`DraftShape`).

A tree is stored flat, root first, every parent before its children:

    node:     0     1     2     3     4
    token:   r     a     b     c     d        r = root = the last verified token (not yet in the KV cache)
    parent:  -1    0     0     1     1        a, b are children of r; c, d children of a
    depth:   0     1     1     2     2        position of node i = seq_len + depth[i]

`mask[i, j]` is True iff j is i or an ancestor of i: row 3 (c) sees r, a, c.
`first_child` / `next_sibling` are the links verification walks (-1 = none).

This module knows nothing about models or drafting methods; drafters build trees with
`DraftTree.from_parents`, the engine pads them with `TreeBatch.from_trees`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from specserve.staging import to_device


@dataclass(frozen=True)
class DraftTree:
    """One request's draft tree (N = num nodes, root included).

    Shape:
        tokens: (N,) int64
        parents: (N,) int64, parents[0] == -1
        depth: (N,) int64, depth[0] == 0
        mask: (N, N) bool
        first_child: (N,) int64
        next_sibling: (N,) int64
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor

    @property
    def num_draft_tokens(self) -> int:
        """The tokens one verify checks for this tree, root included (SGLang's num_draft_tokens)."""
        return self.tokens.shape[0]

    @classmethod
    def from_parents(cls, tokens: Sequence[int], parents: Sequence[int]) -> DraftTree:
        """Build depth, mask and links from a flat (token, parent) list, root first.

        Siblings keep the order they have in the list (verification tries them in that order).
        """
        n = len(tokens)
        if n == 0 or len(parents) != n or parents[0] != -1:
            raise ValueError("tree: need >= 1 node, one parent per token, and parents[0] == -1")
        depth = [0] * n
        ancestors: list[list[int]] = [[0]]  # per node: itself and its ancestors
        first_child = [-1] * n
        next_sibling = [-1] * n
        last_child = [-1] * n
        for i in range(1, n):
            p = parents[i]
            if not 0 <= p < i:
                raise ValueError(f"tree: parent of node {i} is {p}; parents must come before children")
            depth[i] = depth[p] + 1
            ancestors.append([*ancestors[p], i])
            if last_child[p] < 0:
                first_child[p] = i
            else:
                next_sibling[last_child[p]] = i
            last_child[p] = i
        mask = np.zeros((n, n), dtype=np.bool_)  # built in numpy: a drafter builds trees every step
        rows = [i for i, anc in enumerate(ancestors) for _ in anc]
        cols = [j for anc in ancestors for j in anc]
        mask[rows, cols] = True
        links = torch.from_numpy(np.array([list(tokens), list(parents), depth, first_child, next_sibling],
                                          dtype=np.int64))
        mask = torch.from_numpy(mask)
        return cls(
            tokens=links[0], parents=links[1], depth=links[2], mask=mask, first_child=links[3], next_sibling=links[4]
        )

    def with_path(self, tokens: Sequence[int]) -> DraftTree:
        """This tree with `tokens` as a path below the root: through the nodes that already spell its
        start, then new nodes after the existing ones (so their indices stay as they were)."""
        toks, parents = self.tokens.tolist(), self.parents.tolist()
        n, node = len(toks), 0
        for t in tokens:
            child = next((c for c in range(node + 1, len(toks)) if parents[c] == node and toks[c] == t), None)
            if child is None:
                toks.append(t)
                parents.append(node)
                child = len(toks) - 1
            node = child
        return self if len(toks) == n else DraftTree.from_parents(toks, parents)

    def prefix(self, n: int) -> DraftTree:
        """The tree of its first n nodes (parents come before children, so they are a tree): links to
        the nodes left out become -1 (a node's later siblings and children come after it)."""
        if n >= self.num_draft_tokens:
            return self
        if n == 1:  # plain decoding, as often as not at batch 8: no per-tree tensor ops
            return DraftTree(self.tokens[:1], *_ROOT_LINKS)
        cut = [torch.where(links[:n] < n, links[:n], -1) for links in (self.first_child, self.next_sibling)]
        return DraftTree(tokens=self.tokens[:n], parents=self.parents[:n], depth=self.depth[:n],
                         mask=self.mask[:n, :n], first_child=cut[0], next_sibling=cut[1])

    @classmethod
    def root_only(cls, token: int) -> DraftTree:
        """The degenerate tree of plain decoding: just the last verified token."""
        return cls.from_parents([token], [-1])

    @classmethod
    def chain(cls, root: int, drafts: Sequence[int]) -> DraftTree:
        """A linear draft (topk = 1): root -> d0 -> d1 -> ..."""
        return cls.from_parents([root, *drafts], list(range(-1, len(drafts))))


# a root's parents, depth, mask, first_child and next_sibling, shared by `prefix(1)`'s trees (never written)
_ROOT_LINKS = (torch.tensor([-1]), torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool), torch.tensor([-1]),
               torch.tensor([-1]))


@dataclass(frozen=True)
class TreeBatch:
    """B trees padded to N = max nodes. Padding nodes have token 0, depth 0, parent -1 and
    see only themselves, so they never influence a real node.

    Shape:
        tokens, parents, depth, first_child, next_sibling: (B, N) int64
        mask: (B, N, N) bool
        num_draft_tokens: (B,) int64, each tree's own (<= N)
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    num_draft_tokens: torch.Tensor

    @property
    def is_root_only(self) -> bool:
        return self.tokens.shape[1] == 1

    def to(self, device: torch.device) -> TreeBatch:
        """The batch on `device`, each tensor copied through the pinned staging ring (`staging`)."""
        return TreeBatch(*(to_device(getattr(self, f.name), device) for f in fields(self)))

    def prefix(self, n: int) -> TreeBatch:
        """Every tree's first n nodes, on its device with no host read (as `DraftTree.prefix`: links
        to the nodes left out become -1)."""
        if n >= self.tokens.shape[1]:
            return self
        first_child, next_sibling = (torch.where(links[:, :n] < n, links[:, :n], -1)
                                     for links in (self.first_child, self.next_sibling))
        return TreeBatch(self.tokens[:, :n], self.parents[:, :n], self.depth[:, :n], self.mask[:, :n, :n],
                         first_child, next_sibling, self.num_draft_tokens.clamp(max=n))

    def unbatch(self) -> list[DraftTree]:
        """The B trees on the host, padding cut off."""
        host = self.to(torch.device("cpu"))
        return [
            DraftTree(tokens=host.tokens[i, :n], parents=host.parents[i, :n], depth=host.depth[i, :n],
                      mask=host.mask[i, :n, :n], first_child=host.first_child[i, :n],
                      next_sibling=host.next_sibling[i, :n])
            for i, n in enumerate(host.num_draft_tokens.tolist())
        ]

    @classmethod
    def root_only(cls, roots: torch.Tensor) -> TreeBatch:
        """B trees of their root alone (plain decoding), built on roots' device. roots: (B,) int64."""
        b, dev = roots.shape[0], roots.device

        def column(value: int) -> torch.Tensor:
            return torch.full((b, 1), value, dtype=torch.int64, device=dev)

        return cls(roots[:, None], column(-1), column(0), torch.ones(b, 1, 1, dtype=torch.bool, device=dev),
                   column(-1), column(-1), torch.ones(b, dtype=torch.int64, device=dev))

    @classmethod
    def from_trees(cls, trees: Sequence[DraftTree]) -> TreeBatch:
        """The trees (on the host) padded into one batch; built in numpy, one scatter per field (a
        batch-8 step of small trees: about half the time of per-tree tensor copies)."""
        if len(trees) == 1:  # nothing to pad: the tree's own tensors, one row each
            t = trees[0]
            return cls(tokens=t.tokens[None], parents=t.parents[None], depth=t.depth[None], mask=t.mask[None],
                       first_child=t.first_child[None], next_sibling=t.next_sibling[None],
                       num_draft_tokens=torch.tensor([t.num_draft_tokens], dtype=torch.int64))
        sizes = np.array([t.num_draft_tokens for t in trees], dtype=np.int64)
        b, n = len(trees), int(sizes.max())
        rows = np.repeat(np.arange(b), sizes)  # each real node's (row, column)
        cols = np.arange(len(rows)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        links = {}
        for name, fill in (("tokens", 0), ("parents", -1), ("depth", 0), ("first_child", -1), ("next_sibling", -1)):
            out = np.full((b, n), fill, dtype=np.int64)
            out[rows, cols] = np.concatenate([getattr(t, name).numpy() for t in trees])
            links[name] = torch.from_numpy(out)
        mask = np.zeros((b, n, n), dtype=bool)
        mask[:, np.arange(n), np.arange(n)] = True  # padding nodes see themselves
        for i, (t, k) in enumerate(zip(trees, sizes.tolist())):
            mask[i, :k, :k] = t.mask.numpy()
        return cls(mask=torch.from_numpy(mask), num_draft_tokens=torch.from_numpy(sizes), **links)


class DynamicTreeBuilder:
    """EAGLE-2's dynamic draft tree, grown step by step by a model-based drafter.

    Step 0 takes the drafter's topk tokens after the root. Each later step expands every beam node
    by its topk children, scores them by cumulative probability (parent score x child prob) and
    keeps the best topk of the topk^2 as the next beam. `build` reranks all scored nodes, keeps the
    best num_draft_tokens - 1 in rank order (parents precede children) and prepends the root.
    The drafter owns the forwards; this class only does the bookkeeping.
    """

    def __init__(self, root: int) -> None:
        self.tokens: list[int] = [root]
        self.parents: list[int] = [-1]
        self.scores: list[float] = [1.0]
        self.beam: list[int] = [0]  # node indices to expand next

    def expand(self, child_tokens: torch.Tensor, child_probs: torch.Tensor, topk: int) -> list[int]:
        """Add children for every beam node; returns the new beam (node indices).

        child_tokens, child_probs: (len(beam), topk), the drafter's topk after each beam node,
        in beam order. Returns the best `topk` of the new nodes by cumulative probability.
        """
        new_nodes = []
        probs = child_probs.tolist()  # host sync: the tree's shape is decided on the host
        for row, parent in enumerate(self.beam):
            for tok, p in zip(child_tokens[row].tolist(), probs[row]):
                self.tokens.append(tok)
                self.parents.append(parent)
                self.scores.append(self.scores[parent] * p)
                new_nodes.append(len(self.tokens) - 1)
        new_nodes.sort(key=lambda i: (-self.scores[i], i))
        self.beam = new_nodes[:topk]
        return self.beam

    def build(self, num_draft_tokens: int) -> DraftTree:
        """Top (num_draft_tokens - 1) nodes by score (ties: older first, so parents win), root first,
        in rank order: a parent outranks its children, so it precedes them, and the tree for a
        smaller num_draft_tokens is a prefix of this one."""
        ranked = sorted(range(1, len(self.tokens)), key=lambda i: (-self.scores[i], i))
        kept = ranked[: num_draft_tokens - 1]
        index = {0: 0, **{old: new + 1 for new, old in enumerate(kept)}}
        return DraftTree.from_parents(
            [self.tokens[0], *(self.tokens[i] for i in kept)],
            [-1, *(index[self.parents[i]] for i in kept)],
        )


@dataclass(frozen=True, order=True)
class DraftShape:
    """One step's tree: depth (`num_steps`), branching (`topk`) and size (`num_draft_tokens`, root
    included). num_draft_tokens == 1 is plain decoding."""

    num_draft_tokens: int
    num_steps: int
    topk: int

    @property
    def drafts(self) -> bool:
        return self.num_draft_tokens > 1

    @property
    def scratch(self) -> int:
        """The draft K/V entries its beam writes after a request's cached tokens (`scratch_entries`)."""
        return scratch_entries(self.num_steps, self.topk)

    def __str__(self) -> str:
        return f"{self.num_steps}/{self.topk}/{self.num_draft_tokens}"


def scratch_entries(num_steps: int, topk: int) -> int:
    """A beam's draft K/V entries: topk per draft step after the first, whose children come from
    the root's own forward (none for plain decoding)."""
    return max((num_steps - 1) * topk, 0)
