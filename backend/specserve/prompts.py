"""Prompt sources: the chat template of a model directory; MT-bench and JSONL files come from
`specserve_client.datasets`, so the server's benchmarks and the client's load tests share them.

`render_chat` renders a model's chat template the way transformers' `apply_chat_template` does
(the same jinja2 sandbox, options, globals and special-token variables) without importing
transformers, which costs seconds of CPU in every process that serves a model. A template this
environment cannot compile (an extension tag such as `{% generation %}`) is rendered by
transformers itself. It does not tokenize: the `tokenizers` library does that.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from specserve_client.datasets import MTBENCH_PATH, load_questions, load_schemas, mtbench_file

__all__ = ["MTBENCH_PATH", "ChatTemplate", "NoChatTemplate", "chat_template", "hf_tokenizer", "load_questions",
           "load_schemas", "mtbench_file", "render_chat"]

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@functools.lru_cache(maxsize=4)
def hf_tokenizer(model_dir: str):  # noqa: ANN202 - transformers type
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class ChatTemplate:
    """A model directory's chat template (`chat_template.jinja`, else `tokenizer_config.json`'s
    `chat_template`), compiled in jinja2's immutable sandbox with transformers' options
    (`trim_blocks`, `lstrip_blocks`, loop controls) and globals (`raise_exception`, `strftime_now`,
    a `tojson` that keeps non-ASCII), and rendered with the special tokens as variables."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
                   separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)  # raises jinja2.TemplateSyntaxError on unknown tags
        self._special_tokens = special_tokens

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """None when the directory has no chat template."""
        model_dir = Path(model_dir)
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        source = config.get("chat_template")
        if (model_dir / "chat_template.jinja").is_file():
            source = (model_dir / "chat_template.jinja").read_text()
        if isinstance(source, list):  # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        tokens = {name: value["content"] if isinstance(value, dict) else str(value)
                  for name in SPECIAL_TOKENS if (value := config.get(name)) is not None}
        return cls(source, tokens)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self._special_tokens)


@functools.lru_cache(maxsize=4)
def chat_template(model_dir: str) -> ChatTemplate | None:
    """The model's template compiled here; None when it has none or needs transformers' own
    environment (see the module docstring)."""
    import jinja2

    try:
        return ChatTemplate.from_model_dir(model_dir)
    except jinja2.TemplateSyntaxError:
        return None


class NoChatTemplate(ValueError):
    """The model directory has no chat template."""


def render_chat(model_dir: str, user_message: str) -> str:
    """The model's chat template applied to one user turn, ending with the assistant prompt."""
    messages = [{"role": "user", "content": user_message}]
    template = chat_template(str(model_dir))
    if template is not None:
        return template.render(messages)
    tokenizer = hf_tokenizer(str(model_dir))
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate(f"{model_dir} has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
