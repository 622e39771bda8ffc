"""Prompt sources: the chat template of a model directory; MT-bench and JSONL files come from
`specserve_client.datasets`, so the server's benchmarks and the client's load tests share them."""

from __future__ import annotations

import functools

from specserve_client.datasets import MTBENCH_PATH, load_questions, mtbench_file

__all__ = ["MTBENCH_PATH", "hf_tokenizer", "load_questions", "mtbench_file", "render_chat"]


@functools.lru_cache(maxsize=4)
def hf_tokenizer(model_dir: str):  # noqa: ANN202 - transformers type
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def render_chat(model_dir: str, user_message: str) -> str:
    """The model's chat template applied to one user turn, ending with the assistant prompt."""
    tok = hf_tokenizer(str(model_dir))
    return tok.apply_chat_template([{"role": "user", "content": user_message}], tokenize=False,
                                   add_generation_prompt=True)
