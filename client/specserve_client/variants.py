"""Served variants by name: `llm_<variant>` and `ensemble_<variant>`, each variant named after its
drafting method (`none`, `ngram`, `eagle`, `eagle3`, `mtp`, `standalone`, `suffix`, `hybrid`). Earlier names are
accepted and mapped, as the server's command line maps them."""

from __future__ import annotations

RENAMED = {"base": "none", "eagle2": "eagle"}  # equal to the server's `specserve.methods.ALIASES` (tested)


def variant_name(name: str) -> str:
    """An argparse `type`: a variant's name for any name it goes by."""
    return RENAMED.get(name, name)
