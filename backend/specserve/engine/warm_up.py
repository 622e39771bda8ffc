"""The adaptive engine's warm-up: every draft shape's step time measured before the first request.

`warm_up(engine)` runs synthetic requests at every batch-size bucket of the engine's
`ShapeChooser`, forcing each shape of its menu in turn, so the chooser starts from this machine's
costs; then it leaves the engine as if nothing had run (no profile, no cached prompt, no counters).
It chooses nothing itself: the chooser keeps what the steps measured.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from specserve.config import SamplingParams
from specserve.engine.prefix_cache import PromptCounters
from specserve.engine.profile import StepProfile

if TYPE_CHECKING:
    from specserve.engine.engine import Engine

log = logging.getLogger(__name__)

WARM_UP_TEXT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts a few tokens cheaply and "
    "verifies them with one forward of the target model, so the output stays exactly the same. "
)


@torch.inference_mode()
def warm_up(engine: Engine, steps_per_shape: int = 2) -> None:
    """Measure every shape's step time at every batch-size bucket on a synthetic prompt (the
    first step of each shape is discarded), so the chooser starts from this machine's costs."""
    config, chooser = engine.config, engine.chooser
    prompt = engine.tokenizer.encode(WARM_UP_TEXT * 2, add_special_tokens=False).ids
    prompt = prompt[: max(1, config.max_seq_len // 4)]
    params = SamplingParams(max_tokens=config.max_seq_len - len(prompt), ignore_eos=True)
    start = time.perf_counter()
    engine.warming_up = True
    for bs in chooser.buckets:
        ids = [engine.add_request(prompt, params, request_id=f"warm-up-{bs}-{i}") for i in range(bs)]
        engine.step()  # admit and prefill
        while any(r.prefilling for r in engine.running):  # a prompt longer than max_num_batched_tokens
            engine.step()
        for shape in chooser.menu:
            for i in range(steps_per_shape):
                engine.forced_shape, engine.observe_steps = shape, i > 0
                engine.step()
        for rid in ids:
            engine.abort(rid)
        engine.step()
    engine.forced_shape, engine.observe_steps, engine.warming_up = None, True, False
    chooser.forget_acceptance()
    engine.profile = StepProfile()
    engine.prefill_budget.decode_s = None  # warm-up steps ran every shape; a prompt token's cost holds
    engine.prefix_cache.forget()  # the synthetic prompt is no one's prefix
    engine.prompt_counters = PromptCounters()
    log.info("adaptive speculation: %d shapes x batch sizes %s measured in %.1f s",
             len(chooser.menu), chooser.buckets, time.perf_counter() - start)
