"""Drafting methods behind one interface (`Drafter`); one file per method."""

from specserve.drafters.base import DraftContext, Drafter, NoDrafter, SequenceView

__all__ = ["DraftContext", "Drafter", "NoDrafter", "SequenceView"]
