"""Drafting methods behind one interface (`Drafter`); one file per method."""

from specserve.drafters.base import Drafter, NoDrafter, SequenceView

__all__ = ["Drafter", "NoDrafter", "SequenceView"]
