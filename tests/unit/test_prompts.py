"""Prompts without transformers: the chat template and the tokenizer give exactly what
transformers' AutoTokenizer gives, and loading them imports neither transformers nor torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from specserve.prompts import ChatTemplate, chat_template, render_chat
from specserve.serving.contract import RequestError
from specserve.serving.tokenizer import PromptTokenizer

TEXTS = ["Hello", "héllo wörld 🤖\n\n  two spaces", "<|im_start|>user\nx<|im_end|>", "",
         "a template in the text: {{ x }} {% raw %}", "日本語のテキスト"]


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_prompt_ids_equal_transformers(smollm2_dir, hf):
    tok = PromptTokenizer(smollm2_dir)
    for text in TEXTS:
        assert tok.encode(text, False) == hf(text)["input_ids"], text
        chat = hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        assert render_chat(str(smollm2_dir), text) == chat
        assert tok.encode(text, True) == hf(chat, add_special_tokens=False)["input_ids"], text


def test_decoded_tokens_equal_transformers(smollm2_dir, hf):
    tok = PromptTokenizer(smollm2_dir)
    for token_id in [*range(0, hf.vocab_size, 61), *hf.all_special_ids, hf.vocab_size - 1]:
        assert tok.decode_token(token_id) == hf.decode([token_id]), token_id


TEMPLATE = """{%- set ns = namespace(n=0) -%}
{{ bos_token }}
{% for m in messages %}
  {% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}
  {% if loop.index > 3 %}{% break %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  <{{ m['role'] }}>{{ m['content'] | tojson }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<assistant #{{ ns.n }}>{% endif %}"""


def test_a_template_renders_as_transformers_renders_it():
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    ours = ChatTemplate(TEMPLATE, tokens)
    for messages in ([{"role": "user", "content": "ünïcode \"quoted\""}],
                     [{"role": "user", "content": str(i)} for i in range(5)]):
        theirs, _ = render_jinja_template([messages], chat_template=TEMPLATE, add_generation_prompt=True, **tokens)
        assert ours.render(messages) == theirs[0]
    with pytest.raises(Exception, match="no tools"):
        ours.render([{"role": "tool", "content": "x"}])


def test_a_template_with_transformers_only_tags_falls_back_to_transformers(smollm2_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(smollm2_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    source = "{% for m in messages %}{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}"
    (model / "chat_template.jinja").write_text(source)
    assert chat_template(str(model)) is None
    assert render_chat(str(model), "hi") == "[hi]"


def test_a_model_without_a_chat_template_is_a_request_error(smollm2_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(smollm2_dir, model, ignore=shutil.ignore_patterns("*.safetensors", "chat_template.jinja"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tok = PromptTokenizer(model)
    assert tok.encode("hi", False)
    with pytest.raises(RequestError, match="apply_chat_template: the model has no chat template"):
        tok.encode("hi", True)


def test_prompts_load_without_transformers_or_torch(smollm2_dir):
    code = ("import sys; from specserve.serving.tokenizer import PromptTokenizer; "
            f"t = PromptTokenizer({str(smollm2_dir)!r}); t.encode('hi', True); t.decode_token(5); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
