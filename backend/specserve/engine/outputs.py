"""What the engine hands back to its callers: one delta per request after each step, and its load."""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_STOP = "stop"  # EOS or a stop string
FINISH_LENGTH = "length"  # max_tokens reached (or the context is full)
FINISH_ABORT = "abort"  # cancelled by the client
FINISH_ERROR = "error"  # the engine failed on this request; `error` says why
FINISH_TIMEOUT = "timeout"  # request_timeout_s passed before it finished; `error` says so
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR, FINISH_TIMEOUT)


@dataclass(frozen=True)
class EngineLoad:
    """How busy the engine is, as the serving gauges show it."""

    waiting: int  # queued for a slot (new arrivals included)
    running: int  # holding a KV slot
    kv_slots_used: int
    prefix_cache_tokens: int = 0  # tokens whose K/V free slots keep for reuse
    prompt_tokens_reused: int = 0  # so far: prompt tokens found in the prefix cache
    prompt_tokens_computed: int = 0  # so far: prompt positions the target computed
    drafter_cache_tokens: int = 0  # tokens of finished requests the drafter keeps to draft from (suffix)


@dataclass
class RequestOutput:
    """A streamed delta of one request.

    token_ids / text: new since the previous output of this request (text is UTF-8 safe; it may
    lag token_ids by a few tokens while a multi-byte character or a possible stop string is held back).
    The counters are cumulative over the request.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (vLLM's name)
    num_output_tokens: int = 0
    num_draft_tokens: int = 0  # draft tokens proposed (root excluded)
    num_accepted_tokens: int = 0  # draft tokens accepted
    num_verify_steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # accepted drafts + 1, per step in this delta
    tree_sizes: list[int] = field(default_factory=list)  # nodes verified (root included; 1 = no draft), per step
    # with SamplingParams.logprobs: per token of token_ids, {token id: (logprob, rank)} (it and the top alternatives)
    logprobs: list[dict[int, tuple[float, int]]] | None = None
    cumulative_logprob: float = 0.0  # over the whole output so far (with SamplingParams.logprobs)

    @property
    def accept_length(self) -> float:
        """Mean tokens per verify step so far (1.0 = no speed-up)."""
        return (self.num_accepted_tokens + self.num_verify_steps) / max(self.num_verify_steps, 1)


class QueueFull(RuntimeError):
    """`add_request` while `max_queue_size` requests already wait: try again later."""


def merge_outputs(acc: RequestOutput | None, out: RequestOutput) -> RequestOutput:
    """Fold a delta into the running total (counters are cumulative already)."""
    if acc is None:
        return out
    out.token_ids = acc.token_ids + out.token_ids
    out.text = acc.text + out.text
    out.accept_lengths = acc.accept_lengths + out.accept_lengths
    out.tree_sizes = acc.tree_sizes + out.tree_sizes
    if acc.logprobs is not None and out.logprobs is not None:
        out.logprobs = acc.logprobs + out.logprobs
    return out
