"""Prompt text -> token ids for the Triton models: the model's `tokenizer.json`, with or without
its chat template. It does not check lengths (`parsing` does) or detokenize outputs (the engine does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from specserve.prompts import NoChatTemplate, render_chat
from specserve.serving.contract import RequestError


class PromptTokenizer:
    """The model's `tokenizer.json` (the `tokenizers` library, as transformers' fast tokenizers run
    it): raw prompts tokenized as-is with the tokenizer's special tokens (like vLLM's backend), or
    wrapped in the model's chat template as one user turn (`prompts.render_chat`)."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer as FastTokenizer

        self._model_dir = str(model_dir)
        self._tok = FastTokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))

    def decode_token(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def encode(self, text: str, apply_chat_template: bool) -> list[int]:
        if not apply_chat_template:
            return self._tok.encode(text).ids
        try:
            text = render_chat(self._model_dir, text)
        except NoChatTemplate:
            raise RequestError("apply_chat_template: the model has no chat template") from None
        return self._tok.encode(text, add_special_tokens=False).ids


class Tokenizer(Protocol):
    def encode(self, text: str, apply_chat_template: bool) -> list[int]: ...
