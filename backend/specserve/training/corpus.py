"""A corpus of the target's own answers: token ids exactly as generated, stored compactly, grown by
appending.

A corpus directory holds

    corpus.json   what made it (target, dtype, length caps, greedy or sampled); a run that appends
                  must match it
    tokens.u16    every row's ids, uint16, concatenated: the prompt as served (chat template with
                  the generation prompt), then the target's answer
    rows.jsonl    one line per row: {"key", "source", "start", "prompt_len", "answer_len", "cut"}
                  (`key`: a hash of the normalised prompt, so a prompt is answered once)

A row's line is written after its ids are flushed, and opening a corpus cuts `tokens.u16` back to
the end of the last row, so a run that was killed keeps every whole row. Vocabularies up to 65,536
ids fit (SmolLM2: 49,152). This module stores and reads; it does not generate (`regenerate`) and
does not train (`train_heads`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

META, TOKENS, ROWS = "corpus.json", "tokens.u16", "rows.jsonl"


def prompt_key(normalised_prompt: str) -> str:
    return hashlib.sha1(normalised_prompt.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Row:
    key: str
    source: str
    start: int  # first id in tokens.u16
    prompt_len: int
    answer_len: int
    cut: bool  # the answer was cut where it began to loop

    @property
    def end(self) -> int:
        return self.start + self.prompt_len + self.answer_len


class Corpus:
    """An open corpus directory: append rows (opened with `meta`, by one process at a time), or read
    its whole rows back as samples (opened without, while a run may be appending)."""

    def __init__(self, path: str | Path, meta: dict | None = None) -> None:
        """Open `path` to read; with `meta`, to append: create it if missing, refuse one made with
        other settings, and cut a half-written tail."""
        self.path = Path(path)
        meta_path = self.path / META
        if meta_path.is_file():
            saved = json.loads(meta_path.read_text())
            if meta is not None and saved != meta:
                diff = {k: (saved.get(k), meta.get(k)) for k in saved.keys() | meta.keys()
                        if saved.get(k) != meta.get(k)}
                raise ValueError(f"corpus: {self.path} was made with other settings (saved, asked): {diff}")
            self.meta = saved
        elif meta is None:
            raise FileNotFoundError(f"corpus: no {META} in {self.path} (run `specserve regenerate-data --out DIR`)")
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            meta_path.write_text(json.dumps(meta, indent=1) + "\n")
            self.meta = meta
        self.rows: list[Row] = []
        rows_path = self.path / ROWS
        if rows_path.is_file():
            for line in rows_path.read_text().splitlines():
                try:
                    self.rows.append(Row(**json.loads(line)))
                except (json.JSONDecodeError, TypeError):
                    break  # a line cut short by a kill (or being written): the rows before it are whole
        if meta is not None:  # opened to append: cut what a killed run left half-written
            rows_path.write_text("".join(json.dumps(r.__dict__) + "\n" for r in self.rows))
            with open(self.path / TOKENS, "ab") as f:
                f.truncate(2 * (self.rows[-1].end if self.rows else 0))
        self.keys = {r.key for r in self.rows}

    @property
    def answer_tokens(self) -> int:
        return sum(r.answer_len for r in self.rows)

    def append(self, key: str, source: str, prompt_ids: list[int], answer_ids: list[int], cut: bool) -> Row:
        ids = np.asarray(prompt_ids + answer_ids)
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.uint16).max):
            raise ValueError("corpus: ids must fit in uint16")
        start = self.rows[-1].end if self.rows else 0
        with open(self.path / TOKENS, "ab") as f:
            f.write(ids.astype(np.uint16).tobytes())
            f.flush()
        row = Row(key, source, start, len(prompt_ids), len(answer_ids), cut)
        with open(self.path / ROWS, "a") as f:
            f.write(json.dumps(row.__dict__) + "\n")
        self.rows.append(row)
        self.keys.add(key)
        return row

    def tokens(self) -> np.ndarray:
        """Every row's ids, memory-mapped (N,) uint16."""
        if not self.rows:
            return np.zeros(0, dtype=np.uint16)
        return np.memmap(self.path / TOKENS, dtype=np.uint16, mode="r", shape=(self.rows[-1].end,))

    def samples(self, max_len: int) -> list[tuple[np.ndarray, int]]:
        """Per row: (ids (T,) int64 cut to max_len, prompt length): answer tokens are ids[prompt_len:]."""
        tokens = self.tokens()
        return [(np.asarray(tokens[r.start : min(r.end, r.start + max_len)], dtype=np.int64), r.prompt_len)
                for r in self.rows if r.prompt_len < max_len]
