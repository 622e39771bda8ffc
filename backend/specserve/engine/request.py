"""One request's mutable state inside the engine: its tokens, slot, counters and pending delta.

The engine thread owns every `Request`; `output()` turns what it gained since the last step into a
`RequestOutput` delta. This module neither schedules nor decodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specserve.config import SamplingParams
from specserve.engine.detokenize import IncrementalDetokenizer
from specserve.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from specserve.engine.grammar import GrammarMatch


@dataclass(eq=False)
class Request:
    """One request's mutable state, owned by the engine thread."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    grammar: GrammarMatch | None = None  # its structured output's matcher, advanced by each emitted token
    arrival: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)  # prompt + generated; last = tree root
    slot: int = -1
    cache_len: int = 0  # tokens whose K/V are in the slot (all of token_ids but the root; while prefilling, fewer)
    num_cached_tokens: int = 0  # prompt tokens whose K/V were reused from the prefix cache
    finish_reason: str | None = None
    error: str | None = None  # why it ended with FINISH_ERROR
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    drafted_last_step: bool = False  # so the drafter has seen all but the last step's tokens
    pending_ids: list[int] = field(default_factory=list)  # generated since the last output
    pending_accept_lengths: list[int] = field(default_factory=list)
    pending_tree_sizes: list[int] = field(default_factory=list)
    pending_logprobs: list[dict[int, tuple[float, int]]] = field(default_factory=list)
    cumulative_logprob: float = 0.0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def cache_salt(self) -> str | None:
        return self.params.cache_salt

    @property
    def prefilling(self) -> bool:
        """Part of its prompt is still to be computed (it has no first token yet)."""
        return len(self.token_ids) == len(self.prompt_ids)

    def output(self) -> RequestOutput:
        finished = self.finish_reason is not None
        out = RequestOutput(
            request_id=self.request_id,
            token_ids=self.pending_ids,
            text=self.detokenizer.delta(final=finished),
            finished=finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=len(self.prompt_ids),
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=self.num_output_tokens,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_verify_steps=self.num_verify_steps,
            accept_lengths=self.pending_accept_lengths,
            tree_sizes=self.pending_tree_sizes,
            logprobs=self.pending_logprobs if self.params.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob,
            error=self.error,
        )
        self.pending_ids, self.pending_accept_lengths, self.pending_tree_sizes = [], [], []
        self.pending_logprobs = []
        return out
