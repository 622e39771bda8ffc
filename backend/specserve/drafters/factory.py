"""Pick the drafter for a resolved SpecConfig."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specserve.config import SpecConfig
from specserve.drafters.base import Drafter, NoDrafter

if TYPE_CHECKING:
    from specserve.engine import Engine


def build_drafter(spec: SpecConfig, engine: Engine) -> Drafter:
    if spec.algorithm == "none":
        return NoDrafter()
    if spec.algorithm == "ngram":
        from specserve.drafters.ngram import NgramDrafter

        return NgramDrafter(spec)
    if spec.algorithm in ("eagle", "eagle3", "mtp"):
        from specserve.drafters.eagle import EagleDrafter

        return EagleDrafter(spec, engine)
    if spec.algorithm == "standalone":
        from specserve.drafters.standalone import StandaloneDrafter

        return StandaloneDrafter(spec, engine)
    raise NotImplementedError(f"algorithm: {spec.algorithm!r} is not implemented yet (see README, Status)")
