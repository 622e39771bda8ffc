"""Pick the drafter for a resolved SpecConfig."""

from __future__ import annotations

from specserve.config import SpecConfig
from specserve.drafters.base import DraftContext, Drafter, NoDrafter


def build_drafter(spec: SpecConfig, ctx: DraftContext) -> Drafter:
    if spec.algorithm == "none":
        return NoDrafter()
    if spec.algorithm == "ngram":
        from specserve.drafters.ngram import NgramDrafter

        return NgramDrafter(spec)
    if spec.algorithm in ("eagle", "eagle3", "mtp"):
        from specserve.drafters.eagle import EagleDrafter

        return EagleDrafter(spec, ctx)
    if spec.algorithm == "standalone":
        from specserve.drafters.standalone import StandaloneDrafter

        return StandaloneDrafter(spec, ctx)
    raise NotImplementedError(f"algorithm: {spec.algorithm!r} is not implemented yet (see README, Status)")
