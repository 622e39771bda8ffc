"""How many prompt tokens a step computes, sized so that running streams keep flowing.

`max_num_batched_tokens` (vLLM's knob) bounds the prompt tokens of any step. While requests are
decoding, a step that also prefills delays each of their next responses by the prefill's time, so
the budget is also sized from this engine's own measured times: the prompt tokens that cost at
most `stall` decode steps (default 3: a stream's longest gap is then about 4 decode steps, where a
512-token chunk on two CPU cores is 15). With nothing decoding, a step takes the whole configured
budget: a prompt alone is prefilled in the fewest, most efficient forwards.

Times come from the steps themselves (wall time, which on CUDA includes the step's one host read):
a decode step's time is a moving average over steps without prompt work; a prompt token's cost is
a moving average of (step time - decode time) / prompt tokens over steps with prompt work. Until
both are known the configured budget holds. This module does not choose which requests' chunks run
(the engine takes them in arrival order) or how they are packed (`runtime.prefill`).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_CHUNK = 16  # prompt tokens a step beside decoding computes at least (within the limit): a prompt progresses


@dataclass
class PrefillBudget:
    """limit: the configured tokens per step (0 = whole prompts); stall: the prompt work a step may
    add beside decoding requests, in decode steps' time; smoothing: weight of a new sample."""

    limit: int
    stall: float = 3.0
    smoothing: float = 0.3
    decode_s: float | None = None  # a step without prompt work, seconds
    token_s: float | None = None  # a prompt token, seconds

    def tokens(self, decoding: bool, unlimited: int) -> int:
        """Prompt tokens this step may compute; `unlimited` stands for a limit of 0 (whole prompts)."""
        limit = self.limit or unlimited
        if not decoding or self.decode_s is None or not self.token_s:
            return limit
        return min(limit, max(MIN_CHUNK, int(self.stall * self.decode_s / self.token_s)))

    def observe(self, step_s: float, prompt_tokens: int, decoding: bool) -> None:
        """A finished step: its wall time, the prompt tokens it computed, whether requests decoded in it."""
        if prompt_tokens == 0:
            if decoding:
                self.decode_s = self._mix(self.decode_s, step_s)
            return
        if decoding and self.decode_s is None:
            return  # no decode time to take out yet
        prompt_s = step_s - (self.decode_s if decoding else 0.0)
        self.token_s = self._mix(self.token_s, max(prompt_s, 0.0) / prompt_tokens)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new
