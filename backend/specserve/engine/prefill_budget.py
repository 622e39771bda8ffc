"""How many prompt tokens a step computes, sized so that running streams keep flowing.

`max_num_batched_tokens` (vLLM's knob) bounds the prompt tokens of any step. While requests are
decoding, a step that also prefills delays each of their next responses by the prefill's time, so
the budget is also sized from this engine's own measured times: the prompt tokens that cost at
most `stall` decode steps (`prefill_stall_steps`, default 3: a stream's longest gap is then about
4 decode steps, where a 512-token chunk on two CPU cores is 15; 0: the configured limit alone).
With nothing decoding, a step takes the whole configured budget: a prompt alone is prefilled in
the fewest, most efficient forwards.

Times come from the steps themselves (wall time, which on CUDA includes the step's one host read):
a decode step's time is a running average over steps without prompt work; the prompt work of a step
(its time less a decode step's, when requests decoded in it) is fitted as a fixed part plus a cost
per token over the last `window` steps with prompt work (least squares; per token alone while their
sizes do not differ). The fixed part matters: priced per token alone, small chunks look dear and the
budget shrinks to its floor. Until both are known the configured budget holds. This module does not
choose which requests' chunks run (the engine takes them in arrival order) or how they are packed
(`runtime.prefill`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.estimates import LinearFit, RunningAverage

MIN_CHUNK = 16  # prompt tokens a step beside decoding computes at least (within the limit): a prompt progresses


@dataclass
class PrefillBudget:
    """limit: the configured tokens per step (0 = whole prompts); stall: the prompt work a step may
    add beside decoding requests, in decode steps' time (0 = no bound but the limit);
    horizon: the decode steps the decode time averages over; window: the steps with prompt work
    the fit reads."""

    limit: int
    stall: float = 3.0
    horizon: int = 3
    window: int = 32
    decode: RunningAverage = field(init=False)  # a step without prompt work, seconds
    prompt: LinearFit = field(init=False)  # a step's prompt work: seconds per prompt token + a fixed part

    def __post_init__(self) -> None:
        self.decode = RunningAverage(self.horizon)
        self.prompt = LinearFit(self.window)

    @property
    def decode_s(self) -> float | None:
        return self.decode.value if self.decode.samples else None

    def forget_decode_time(self) -> None:
        """Drop the decode time (warm-up steps ran every shape); the prompt work's fit holds."""
        self.decode.reset()

    def tokens(self, decoding: bool, unlimited: int) -> int:
        """Prompt tokens this step may compute; `unlimited` stands for a limit of 0 (whole prompts)."""
        limit = self.limit or unlimited
        decode_s, token_s = self.decode_s, self.prompt.slope
        if not decoding or not self.stall or decode_s is None or not token_s:
            return limit
        return min(limit, max(MIN_CHUNK, int((self.stall * decode_s - self.prompt.intercept) / token_s)))

    def observe(self, step_s: float, prompt_tokens: int, decoding: bool) -> None:
        """A finished step: its wall time, the prompt tokens it computed, whether requests decoded in it."""
        if prompt_tokens == 0:
            if decoding:
                self.decode.add(step_s)
            return
        decode_s = self.decode_s
        if decoding and decode_s is None:
            return  # no decode time to take out yet
        self.prompt.add(prompt_tokens, max(step_s - (decode_s if decoding else 0.0), 0.0))
