import json

import pytest

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.model_config import ModelConfig
from specserve_kernels import MAX_NODES


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_tokens": 500, "max_tokens": 10}, "min_tokens"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 5.0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"top_k": 5.5}, "top_k"),
        ({"top_k": "5"}, "top_k"),
        ({"min_tokens": None}, "min_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 10**400}, "temperature"),  # an int too large for a float
        ({"top_p": None}, "top_p"),
        ({"presence_penalty": float("-inf")}, "presence_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"seed": True}, "seed"),
        ({"stop": ["x"]}, "stop"),
        ({"stop": "x"}, "stop"),
        ({"stop": ("x", 1)}, "stop"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": "s" * 257}, "cache_salt"),
        ({"cache_salt": 5}, "cache_salt"),
    ],
)
def test_sampling_params_types_are_strict(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**kwargs)


def test_sampling_params_accepted_types():
    salt, seed = "s" * 256, 2**64 - 1
    p = SamplingParams(temperature=1, top_p=1, repetition_penalty=2, seed=seed, cache_salt=salt, logprobs=0)
    assert type(p.temperature) is float and type(p.top_p) is float and type(p.repetition_penalty) is float
    assert p == SamplingParams(temperature=1.0, repetition_penalty=2.0, seed=seed, cache_salt=salt,
                               logprobs=0)
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(cache_salt="a").cache_salt == "a"


@pytest.mark.parametrize(
    ("temperature", "stored"), [(1e-40, 0.0), (5e-324, 0.0), (9.99e-6, 0.0), (1e-5, 1e-5), (0.7, 0.7)]
)
def test_a_temperature_below_the_sampling_eps_decodes_greedily(temperature, stored):
    p = SamplingParams(temperature=temperature)
    assert p.temperature == stored and p.greedy is (stored == 0.0)


def test_spec_defaults_follow_sglang():
    assert SpecConfig(algorithm="eagle").resolved() == SpecConfig(algorithm="eagle", num_steps=5, topk=4,
                                                                  num_draft_tokens=8)
    chain = SpecConfig(algorithm="eagle3", num_steps=3, topk=1, num_draft_tokens=9).resolved()
    assert chain.num_draft_tokens == 4  # topk=1 forces num_steps + 1
    assert SpecConfig(algorithm="ngram").resolved().num_draft_tokens == 12
    assert SpecConfig(algorithm="mtp").resolved() == SpecConfig(algorithm="mtp", num_steps=1, topk=2,
                                                                num_draft_tokens=3)
    assert SpecConfig(algorithm="mtp", num_steps=3, topk=1).resolved().num_draft_tokens == 4  # a chain of 3
    with pytest.raises(ValueError, match="^algorithm"):
        SpecConfig(algorithm="medusa")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"algorithm": "eagle", "num_draft_tokens": 65}, "num_draft_tokens"),
        ({"algorithm": "ngram", "num_draft_tokens": 100}, "num_draft_tokens"),
        ({"algorithm": "eagle3", "num_steps": 64, "topk": 1}, "num_steps"),  # a chain of 65 tokens
        ({"algorithm": "standalone", "num_steps": 18, "topk": 4, "num_draft_tokens": 8}, "num_steps"),  # 68 scratch
    ],
)
def test_a_shape_beyond_the_tree_limit_names_the_knob_and_the_limit(kwargs, field):
    """No silent trim: a tree over the kernels' MAX_NODES, or a beam whose scratch K/V would not
    fit the cache's as many spare positions, is refused where the config is built."""
    with pytest.raises(ValueError, match=f"^{field}: .*limit of {MAX_NODES} "):
        SpecConfig(**kwargs)
    assert SpecConfig(algorithm="eagle", num_draft_tokens=MAX_NODES).resolved().num_draft_tokens == MAX_NODES
    assert SpecConfig(algorithm="none", num_draft_tokens=100).resolved().num_draft_tokens == 1  # nothing drafts


def test_engine_config_rejects_bad_values():
    with pytest.raises(ValueError, match="^dtype"):
        EngineConfig(model_dir="x", dtype="int8")
    with pytest.raises(ValueError, match="^max_batch_size"):
        EngineConfig(model_dir="x", max_batch_size=0)


def test_model_config_reads_hf_fields(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_theta": 1e6, "eos_token_id": [1, 2], "tie_word_embeddings": False,
    }))
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.head_dim == 8 and cfg.attention_bias and cfg.eos_token_ids == (1, 2)
    assert cfg.default_aux_layers() == (2, 2, 1)
    with pytest.raises(FileNotFoundError, match="^model_dir"):
        ModelConfig.from_dir(tmp_path / "nope")


def test_the_kv_cache_keeps_the_model_dtype_but_compiled_gguf_float16_and_on_cuda_only_dtype():
    assert EngineConfig(model_dir="m", device="cpu", dtype="float32").kv_cache_dtype == "float32"
    gguf = EngineConfig(model_dir="m", device="cpu", load_format="gguf")
    assert (gguf.kv_cache_dtype, gguf.dtype) == ("float16", "float32")  # llama.cpp's cache
    assert EngineConfig(model_dir="m", device="cpu", load_format="gguf", cpu_compile=False).kv_cache_dtype == "float32"
    half = EngineConfig(model_dir="m", device="cpu", dtype="float32", kv_cache_dtype="float16")
    assert (half.kv_cache_dtype, half.dtype) == ("float16", "float32")
    assert EngineConfig(model_dir="m", device="cuda", dtype="bfloat16").kv_cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="kv_cache_dtype: on cuda the cache keeps dtype's numbers"):
        EngineConfig(model_dir="m", device="cuda", dtype="bfloat16", kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model_dir="m", device="cpu", kv_cache_dtype="int8")
