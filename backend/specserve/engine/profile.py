"""Where verify-step time goes: `StepProfile`'s per-phase seconds and the clock that times them.

The engine times each phase of a verify step with `step_clock` and adds the differences to its
`StepProfile`; `per_step_ms` is what the bench reports. This module times nothing by itself and
knows nothing of the step's work.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class StepProfile:
    """Seconds spent per phase of the verify steps so far (prefill steps are left out).

    draft: drafter.propose (catch-up forward included); forward: the target's verify forward;
    verify: acceptance and KV compaction (the step's one host sync); drafter_update: on_accept;
    bookkeeping: the rest of the step (appending tokens, stop checks, detokenizing, outputs).
    drafting_steps: the steps that drafted; draft_forwards: the draft model forwards their
    proposes ran (catch-ups included); draft_model: the part of the draft phase spent inside those
    forwards and the draft model's output layer (`Drafter.forward_seconds`). device_wait: time the
    host waited for the device (the step's host read, and the profile's own syncs on CUDA), so
    host_work = total - device_wait is the host's share of a step (on a CPU, all of it).
    grammar: the part of the draft and verify phases spent on structured outputs (the forced
    text drafted, drafts the grammar forbids pruned, the masks), over grammar_nodes verified tree
    nodes under a grammar; grammar_pruned: the drafted nodes it pruned before the forward.
    """

    steps: int = 0
    drafting_steps: int = 0
    draft_forwards: int = 0
    grammar_nodes: int = 0
    grammar_pruned: int = 0
    draft: float = 0.0
    draft_model: float = 0.0
    forward: float = 0.0
    verify: float = 0.0
    drafter_update: float = 0.0
    total: float = 0.0  # whole verify steps, outputs included
    device_wait: float = 0.0
    grammar: float = 0.0

    def overhead_seconds(self) -> float:
        """A verify step's mean seconds besides the target's forward (0 before the first step)."""
        return (self.total - self.forward) / self.steps if self.steps else 0.0

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per step of each phase, bookkeeping = total - the timed phases; the draft
        phase also per drafting step and per draft forward."""
        counts = ("steps", "drafting_steps", "draft_forwards", "grammar_nodes", "grammar_pruned")
        n = max(self.steps, 1)
        out = {k: round(v * 1e3 / n, 3) for k, v in asdict(self).items() if k not in counts}
        out["bookkeeping"] = round(
            out["total"] - out["draft"] - out["forward"] - out["verify"] - out["drafter_update"], 3
        )
        out["host_work"] = round(out["total"] - out["device_wait"], 3)
        if self.drafting_steps:
            out["draft_per_drafting_step"] = round(self.draft * 1e3 / self.drafting_steps, 3)
        if self.draft_forwards:
            out["draft_per_forward"] = round(self.draft * 1e3 / self.draft_forwards, 3)
            out["draft_model_per_forward"] = round(self.draft_model * 1e3 / self.draft_forwards, 3)
        if self.grammar_nodes:
            out["grammar_per_node"] = round(self.grammar * 1e3 / self.grammar_nodes, 4)
        return {k: getattr(self, k) for k in counts} | out


def step_clock(profile: StepProfile, device: torch.device, synchronize: bool) -> float:
    """Host time; on CUDA with `synchronize` (profiling: it costs a sync), after the queued work,
    the wait counted in the profile's device_wait."""
    now = time.perf_counter()
    if synchronize and device.type == "cuda":
        torch.cuda.synchronize(device)
        waited = time.perf_counter()
        profile.device_wait += waited - now
        return waited
    return now
