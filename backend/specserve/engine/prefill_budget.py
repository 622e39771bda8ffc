"""How many prompt tokens a step computes, sized so that running streams keep flowing.

`max_num_batched_tokens` (vLLM's knob) bounds the prompt tokens of any step. While requests are
decoding, a step that also prefills delays each of their next responses by the prefill's time, so
the budget is also sized from this engine's own measured times: the prompt tokens that cost at
most `stall` decode steps (`prefill_stall_steps`, default 3: a stream's longest gap is then about
4 decode steps, where a 512-token chunk on two CPU cores is 15; 0: the configured limit alone).
With nothing decoding, a step takes the whole configured budget: a prompt alone is prefilled in
the fewest, most efficient forwards.

Times come from the steps themselves (wall time, which on CUDA includes the step's one host read):
a decode step's time is a moving average over steps without prompt work; the prompt work of a step
(its time less a decode step's, when requests decoded in it) is fitted as a fixed part plus a cost
per token over the last `window` steps with prompt work (least squares; per token alone while their
sizes do not differ). The fixed part matters: priced per token alone, small chunks look dear and the
budget shrinks to its floor. Until both are known the configured budget holds. This module does not
choose which requests' chunks run (the engine takes them in arrival order) or how they are packed
(`runtime.prefill`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MIN_CHUNK = 16  # prompt tokens a step beside decoding computes at least (within the limit): a prompt progresses


@dataclass
class PrefillBudget:
    """limit: the configured tokens per step (0 = whole prompts); stall: the prompt work a step may
    add beside decoding requests, in decode steps' time (0 = no bound but the limit);
    smoothing: weight of a new decode sample; window: the steps with prompt work the fit reads."""

    limit: int
    stall: float = 3.0
    smoothing: float = 0.3
    window: int = 32
    decode_s: float | None = None  # a step without prompt work, seconds
    token_s: float | None = None  # a prompt token, seconds (the fit's slope)
    overhead_s: float = 0.0  # a step's prompt work's fixed part, seconds
    samples: deque[tuple[int, float]] = field(init=False)  # (prompt tokens, seconds), the last `window`

    def __post_init__(self) -> None:
        self.samples = deque(maxlen=self.window)

    def tokens(self, decoding: bool, unlimited: int) -> int:
        """Prompt tokens this step may compute; `unlimited` stands for a limit of 0 (whole prompts)."""
        limit = self.limit or unlimited
        if not decoding or not self.stall or self.decode_s is None or not self.token_s:
            return limit
        return min(limit, max(MIN_CHUNK, int((self.stall * self.decode_s - self.overhead_s) / self.token_s)))

    def observe(self, step_s: float, prompt_tokens: int, decoding: bool) -> None:
        """A finished step: its wall time, the prompt tokens it computed, whether requests decoded in it."""
        if prompt_tokens == 0:
            if decoding:
                self.decode_s = step_s if self.decode_s is None else \
                    (1 - self.smoothing) * self.decode_s + self.smoothing * step_s
            return
        if decoding and self.decode_s is None:
            return  # no decode time to take out yet
        self.samples.append((prompt_tokens, max(step_s - (self.decode_s if decoding else 0.0), 0.0)))
        self._fit()

    def _fit(self) -> None:
        """seconds = overhead_s + token_s * tokens, least squares over the window."""
        n = [float(x) for x, _ in self.samples]
        t = [y for _, y in self.samples]
        mean_n, mean_t = sum(n) / len(n), sum(t) / len(t)
        var = sum((x - mean_n) ** 2 for x in n)
        slope = sum((x - mean_n) * (y - mean_t) for x, y in zip(n, t)) / var if var > 0 else 0.0
        if slope > 0 and mean_t - slope * mean_n >= 0:
            self.token_s, self.overhead_s = slope, mean_t - slope * mean_n
        else:  # one size only, or noise: per token alone
            self.token_s, self.overhead_s = mean_t / mean_n, 0.0
