"""The draft plan: the tree shapes a SpecConfig lets a step draft, worked out once.

`DraftPlan.of(spec)` resolves the configured shape (`SpecConfig.resolved`), decides whether it is
pinned (the user set num_steps, topk or num_draft_tokens, or turned `adaptive` off) and, if not,
the menu of smaller shapes adaptive speculation chooses from (`shape_menu`). The engine, the
runtime's buckets and the drafters read the plan; none of them works a shape out again.

Tree sizes are bounded by the kernels' `MAX_NODES` (a tree's rows live in registers); the cache
keeps that many spare positions per slot, where a draft's scratch K/V go. `SpecConfig` refuses a
shape beyond these limits where it is built, so the plan never trims one. Trimming a step's trees
to the context a request has left is the engine's (`Engine._fit_trees`), not the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.config import SpecConfig
from specserve.tree import DraftShape
from specserve_kernels import MAX_NODES

MENU_NUM_DRAFT_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def shape_menu(num_steps: int, topk: int, num_draft_tokens: int) -> tuple[DraftShape, ...]:
    """The shapes a step may choose, smallest first; the last is the configured one."""
    sizes = [n for n in MENU_NUM_DRAFT_TOKENS if n < num_draft_tokens] + [num_draft_tokens]
    return tuple(
        DraftShape(n, min(num_steps, n - 1), topk if n > 1 else 1) if n > 1 else DraftShape(1, 0, 1)
        for n in sizes
    )


@dataclass(frozen=True)
class DraftPlan:
    """What every step may draft, from one SpecConfig.

    spec: the resolved config (unset values filled, `SpecConfig.resolved`); shape: the configured
    shape, the largest a step drafts; menu: the shapes a step may choose, smallest first, the last
    `shape` (`shape` alone when pinned or plain decoding); pinned: the user fixed the shape;
    scratch: the draft K/V entries a beam of `shape` writes after a request's cached tokens
    (`DraftShape.scratch`); max_nodes: the most nodes a tree may have, root included.
    """

    spec: SpecConfig
    shape: DraftShape
    menu: tuple[DraftShape, ...]
    pinned: bool
    scratch: int
    max_nodes: int = MAX_NODES

    @classmethod
    def of(cls, spec: SpecConfig) -> DraftPlan:
        """The plan of a SpecConfig as configured (0 = unset: the method's default)."""
        resolved = spec.resolved()
        shape = DraftShape(resolved.num_draft_tokens, resolved.num_steps, resolved.topk)
        pinned = not spec.adaptive or bool(spec.num_steps or spec.topk or spec.num_draft_tokens)
        drafts = resolved.method.drafts
        menu = shape_menu(shape.num_steps, shape.topk, shape.num_draft_tokens) if drafts and not pinned else (shape,)
        return cls(resolved, shape, menu, pinned, scratch=shape.scratch)

    @property
    def tree_sizes(self) -> tuple[int, ...]:
        """The node counts a verify step may see: 1 (plain decoding) and each shape of the menu's."""
        return tuple(sorted({1, *(s.num_draft_tokens for s in self.menu)}))
