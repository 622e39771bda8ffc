"""Fixtures for unit tests that need an engine: a tiny random Llama with SmolLM2's tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file


def save_tiny_llama(path, vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=8, seed=0):
    """A random HF Llama checkpoint (tied embeddings) under path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                                      intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      tie_word_embeddings=True, eos_token_id=2))
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(state, path / "model.safetensors")
    hf.config.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2_dir):
    """8 layers, hidden 64, SmolLM2's vocabulary, tokenizer and chat template (so the engine and
    train-drafter can run it)."""
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny_target"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_llama_factory(tmp_path_factory):
    """save_tiny_llama into a fresh directory, any shape."""
    return lambda **kw: save_tiny_llama(tmp_path_factory.mktemp("tiny"), **kw)


@pytest.fixture(scope="module")
def data_file(request, tmp_path_factory):
    """The test module's `CONVERSATIONS` as a ShareGPT-shaped JSON file."""
    path = tmp_path_factory.mktemp("data") / "sharegpt.json"
    path.write_text(json.dumps(request.module.CONVERSATIONS))
    return path


@pytest.fixture
def fresh_compile_cache(tmp_path):
    """An empty compile cache for programs whose op libraries are those already built in the default
    cache (each kept under its source's digest and torch's version, built under a file lock): a
    test of how programs are compiled and loaded does not also rebuild the C++ ops in a subprocess."""
    from specserve.config import EngineConfig

    cache = tmp_path / "cache"
    cache.mkdir()
    shared = EngineConfig(model_dir="").compile_cache_path / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(shared, target_is_directory=True)
    return cache
