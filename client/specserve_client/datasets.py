"""Prompts for load tests and benchmarks: `specserve.prompts` (MT-bench first turns or a JSONL
file), cycled to the number of requests asked for."""

from __future__ import annotations

from specserve.prompts import load_questions


def load_prompts(dataset: str = "mtbench", num_prompts: int | None = None) -> list[str]:
    prompts = load_questions(dataset)
    if num_prompts is None:
        return prompts
    return [prompts[i % len(prompts)] for i in range(num_prompts)]
