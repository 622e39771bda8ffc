"""Build the drafter of a resolved SpecConfig: the class its method names (`methods.Method.drafter`)."""

from __future__ import annotations

import importlib

from specserve.config import SpecConfig
from specserve.drafters.base import DraftContext, Drafter
from specserve.methods import method

# Method.drafter -> the class that runs it (imported when first built: each pulls in its own models)
DRAFTERS = {
    "none": "specserve.drafters.base:NoDrafter",
    "ngram": "specserve.drafters.ngram:NgramDrafter",
    "head": "specserve.drafters.eagle:EagleDrafter",
    "model": "specserve.drafters.standalone:StandaloneDrafter",
}


def build_drafter(spec: SpecConfig, ctx: DraftContext) -> Drafter:
    module, name = DRAFTERS[method(spec.algorithm).drafter].split(":")
    drafter: type[Drafter] = getattr(importlib.import_module(module), name)
    return drafter.build(spec, ctx)
