"""Build the drafter of a resolved SpecConfig: the class its method names (`methods.Method.drafter`)."""

from __future__ import annotations

import importlib

from specserve.config import SpecConfig
from specserve.drafters.base import DraftContext, Drafter


def build_drafter(spec: SpecConfig, ctx: DraftContext) -> Drafter:
    """Imported when first built: each drafter pulls in its own models."""
    module, name = spec.method.drafter.split(":")
    drafter: type[Drafter] = getattr(importlib.import_module(module), name)
    return drafter.build(spec, ctx)
