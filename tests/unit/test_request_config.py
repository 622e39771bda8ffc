"""What passes between the Triton models, on numpy dicts (no Triton, no model): the preprocessing
model's request config to the decoupled model, the responses, the config.pbtxt parameters, and the
repository's configs against the contract."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from request_inputs import LIMITS, REPO, FakeTokenizer, b, f32, flag, i32, req, sp, words

from specserve.config import SamplingParams
from specserve.serving.contract import (
    CONTRACT_INPUTS,
    INTERNAL_INPUTS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    OUTPUTS,
    GenerateRequest,
    RequestError,
    RequestLimits,
    ResponseDelta,
    logprobs_entries,
    output_arrays,
)
from specserve.serving.parameters import (
    engine_config_from_parameters,
    model_parameters,
    request_limits_from_parameters,
)
from specserve.serving.parsing import (
    decode_request_config,
    encode_request_config,
    parse_decoupled_inputs,
    parse_request,
)
from specserve.serving.repository import llm_inputs, llm_outputs

# ---- preprocessing -> llm ---------------------------------------------------------------


ROUND_TRIPS = [
    GenerateRequest(SamplingParams(max_tokens=9, temperature=0.3, stop=("x", "yz"), seed=5), True, None),
    GenerateRequest(SamplingParams(max_tokens=LIMITS.max_tokens_limit, seed=2**64 - 1, cache_salt="tenant-1"),
                    False, "Q"),
    GenerateRequest(SamplingParams(temperature=1, top_p=0.9, top_k=40, min_tokens=3, ignore_eos=True,
                                   logprobs=20, presence_penalty=-2, frequency_penalty=0.5,
                                   repetition_penalty=1.1), True, None),
    GenerateRequest(SamplingParams(stop=("é☃\u0000",) * MAX_STOP_STRINGS, cache_salt="s" * 256), False,
                    "\u0000\x1f\U0001f600" * 100),
    GenerateRequest(SamplingParams(stop=("s" * MAX_STOP_CHARS,), temperature=1e-40, seed=0), False, ""),
]


@pytest.mark.parametrize("gen", ROUND_TRIPS)
def test_request_config_round_trip(gen):
    arr = encode_request_config(gen)
    assert arr.dtype == np.object_ and arr.shape == (1,)
    assert decode_request_config(arr[0], LIMITS) == gen


@pytest.mark.parametrize(
    "inputs",
    [
        req(),
        req("é" * 100, sampling_parameters=sp({"seed": 7, "cache_salt": "tenant", "logprobs": True,
                                                "top_k": -1, "stop": ["a"] * MAX_STOP_STRINGS,
                                                "temperature": "0.5"})),
        req(exclude_input_in_output=flag(False), stop_words=words(b"x" * MAX_STOP_CHARS, b""),
            seed=np.array([2**64 - 1], dtype=np.uint64), temperature=f32(1e-30), max_tokens=i32(255)),
        req(stream=flag(True), exclude_input_in_output=flag(True), return_logprobs=flag(True),
            min_tokens=i32(2)),
    ],
)
def test_every_parsed_request_survives_the_round_trip(inputs):
    """What preprocessing encodes, the decoupled model decodes to the same request."""
    parsed = parse_request(inputs, LIMITS).request
    assert decode_request_config(encode_request_config(parsed)[0], LIMITS) == parsed


def test_request_config_malformed():
    for raw in (b"{}", b"nope", b"", json.dumps({"params": {"max_tokens": 0}, "stream": False}).encode()):
        with pytest.raises(RequestError, match=r"^request_config|^max_tokens"):
            decode_request_config(raw, LIMITS)


def config(params: dict | None = None, **payload: object) -> bytes:
    """A request_config as a client could forge it: SamplingParams() as JSON, with overrides."""
    base = {"params": {**dict(max_tokens=8), **(params or {})}, "stream": False, "echo_text": None}
    return json.dumps({**base, **payload}).encode()


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (config({"top_k": 5.5}), "top_k"),
        (config({"top_k": True}), "top_k"),
        (config({"max_tokens": "8"}), "max_tokens"),
        (config({"max_tokens": LIMITS.max_tokens_limit + 1}), "max_tokens"),
        (config({"temperature": "hot"}), "temperature"),
        (config({"temperature": True}), "temperature"),
        (config({"logprobs": 1.5}), "logprobs"),
        (config({"logprobs": 21}), "logprobs"),
        (config({"seed": -1}), "seed"),
        (config({"seed": 2**64}), "seed"),
        (config({"seed": 1.5}), "seed"),
        (config({"ignore_eos": "yes"}), "ignore_eos"),
        (config({"cache_salt": ""}), "cache_salt"),
        (config({"cache_salt": 3}), "cache_salt"),
        (config({"stop": "x"}), "request_config.params.stop"),
        (config({"stop": ["x", 1]}), "request_config.params.stop"),
        (config({"stop": ["x", ""]}), "stop"),
        (config({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}), "request_config.params.stop"),
        (config({"stop": ["x" * (MAX_STOP_CHARS + 1)]}), "request_config.params.stop"),
        (config({"beam_width": 2}), "request_config.params.beam_width"),
        (config(stream=1), "request_config.stream"),
        (config(stream="true"), "request_config.stream"),
        (config(echo_text=5), "request_config.echo_text"),
        (config(extra=True), "request_config.extra"),
        (json.dumps({"params": [], "stream": False}).encode(), "request_config.params"),
        (json.dumps({"params": {}}).encode(), "request_config.stream"),
        (json.dumps([1]).encode(), "request_config"),
        (b"[" * 50_000, "request_config"),
        (b'{"params": ' + b"[" * 50_000, "request_config"),
        (b'{"params": {"stop": ' + b"[" * 900 + b"]" * 900 + b'}, "stream": false}',
         "request_config.params.stop"),
        (b"\xff", "request_config"),
        (b" " * (LIMITS.max_request_config_bytes + 1), "request_config"),
    ],
)
def test_a_forged_request_config_is_refused_naming_the_field(raw, field):
    with pytest.raises(RequestError) as e:
        decode_request_config(raw, LIMITS)
    assert str(e.value).split(":")[0] == field


def test_a_too_deeply_nested_request_config_says_so():
    with pytest.raises(RequestError, match=r"^request_config: nested too deeply$"):
        decode_request_config(b"[" * 50_000, LIMITS)


def test_decoupled_inputs_from_preprocessing():
    gen = GenerateRequest(SamplingParams(max_tokens=9), True, None)
    ids, out = parse_decoupled_inputs(
        {"input_ids": np.array([5, 6, 7], dtype=np.int32), "request_config": encode_request_config(gen)},
        LIMITS, FakeTokenizer(),
    )
    assert ids == [5, 6, 7] and out == gen


def test_decoupled_inputs_direct_contract():
    ids, out = parse_decoupled_inputs(req("ab", apply_chat_template=flag(True), stream=flag(True)), LIMITS,
                                      FakeTokenizer())
    assert ids == [1, 97, 98, 2] and out.stream is True


@pytest.mark.parametrize(
    ("inputs", "field"),
    [
        ({"input_ids": np.array([1], dtype=np.int32)}, "input_ids"),  # without request_config
        ({"input_ids": np.array([1], dtype=np.int32), "request_config": b("{}"), "text_input": b("x")}, "input_ids"),
        ({"input_ids": np.array([], dtype=np.int32),
          "request_config": encode_request_config(GenerateRequest(SamplingParams()))}, "input_ids"),
        ({"input_ids": np.array([1.0], dtype=np.float32),
          "request_config": encode_request_config(GenerateRequest(SamplingParams()))}, "input_ids"),
        ({"input_ids": np.zeros(256, dtype=np.int32),
          "request_config": encode_request_config(GenerateRequest(SamplingParams()))}, "input_ids"),
        ({"input_ids": np.array([1], dtype=np.int32), "request_config": b(config({"top_k": 5.5}).decode())},
         "top_k"),
        ({"input_ids": np.array([1], dtype=np.int32),
          "request_config": encode_request_config(GenerateRequest(SamplingParams(max_tokens=999)))}, "max_tokens"),
        (req("x" * 300), "text_input"),  # too long for the context once tokenized
        (req(max_tokens=i32(0)), "max_tokens"),
    ],
)
def test_decoupled_inputs_errors(inputs, field):
    with pytest.raises(RequestError) as e:
        parse_decoupled_inputs(inputs, LIMITS, FakeTokenizer())
    assert str(e.value).split(":")[0] == field


# ---- responses ------------------------------------------------------------------------------


def test_logprobs_output_is_vllm_backend_json():
    entries = logprobs_entries([{5: (-0.1, 1), 9: (-2.5, 2)}], lambda t: f"<{t}>")
    arrays = output_arrays(ResponseDelta("x", [5], None, 3, 1, 0, 0, 1, logprobs=entries, cumulative_logprob=-0.1))
    assert json.loads(arrays["logprobs"][0]) == [{"5": {"logprob": -0.1, "rank": 1, "decoded_token": "<5>"},
                                                  "9": {"logprob": -2.5, "rank": 2, "decoded_token": "<9>"}}]
    assert arrays["cumulative_logprob"].dtype == np.float32 and arrays["cumulative_logprob"][0] == pytest.approx(-0.1)
    plain = output_arrays(ResponseDelta("x", [5], None, 3, 1, 0, 0, 1))
    assert plain["logprobs"][0] == b"null"  # what the OpenAI frontend reads as "no logprobs"


def test_output_arrays():
    arrays = output_arrays(ResponseDelta("é!", [5, 6], "stop", 10, 7, 12, 6, 4))
    assert set(arrays) == set(OUTPUTS)
    assert arrays["text_output"][0].decode() == "é!"
    assert arrays["output_ids"].dtype == np.int32 and arrays["output_ids"].tolist() == [5, 6]
    assert arrays["finish_reason"][0] == b"stop"
    assert arrays["num_input_tokens"].dtype == np.uint32 and arrays["num_output_tokens"][0] == 7
    assert arrays["total_draft_tokens"].dtype == np.int32 and arrays["total_accepted_draft_tokens"][0] == 6
    assert arrays["acceptance_rate"].dtype == np.float32 and arrays["acceptance_rate"][0] == pytest.approx(0.5)
    assert arrays["accept_length"][0] == pytest.approx((6 + 4) / 4)
    empty = output_arrays(ResponseDelta("", [], None, 3, 0, 0, 0, 0))
    assert empty["output_ids"].shape == (0,) and empty["finish_reason"][0] == b""
    assert empty["accept_length"][0] == 0.0 and empty["acceptance_rate"][0] == 0.0


# ---- config.pbtxt parameters ----------------------------------------------------------------


def test_engine_config_from_parameters():
    cfg = engine_config_from_parameters(
        {"model_dir": "", "algorithm": "ngram", "drafter_path": "", "num_steps": "0", "topk": "0",
         "num_draft_tokens": "8", "max_batch_size": "4", "max_seq_len": "512", "dtype": "float32",
         "device": "cpu", "num_threads": "", "default_max_tokens": "64", "apply_chat_template": "true",
         "ngram_max_bfs_breadth": "5", "disable_by_batch_size": "4"}
    )
    assert (cfg.max_batch_size, cfg.max_seq_len, cfg.dtype, cfg.device) == (4, 512, "float32", "cpu")
    assert cfg.spec.algorithm == "ngram" and cfg.spec.num_draft_tokens == 8 and cfg.spec.ngram_max_bfs_breadth == 5
    assert cfg.spec.disable_by_batch_size == 4
    assert cfg.spec.drafter_path is None and cfg.num_threads is None
    assert cfg.model_dir.endswith("models/SmolLM2-135M-Instruct")
    assert engine_config_from_parameters(
        {"model_dir": "/abs/m", "drafter_path": "models/d"}).spec.drafter_path.endswith("/models/d")
    gpu = engine_config_from_parameters({"attention_backend": "torch", "disable_cuda_graph": "true",
                                         "cuda_graph_max_bs": "16"})
    assert (gpu.attention_backend, gpu.graph_mode, gpu.cuda_graph_max_bs) == ("torch", "off", 16)
    assert engine_config_from_parameters({"disable_cuda_graph": "false"}).graph_mode == "auto"
    assert engine_config_from_parameters({"adaptive": "false"}).spec.adaptive is False
    assert engine_config_from_parameters({"adaptive": "true"}).spec.adaptive is True
    assert engine_config_from_parameters({"dtype": "auto", "device": "cpu"}).dtype in ("bfloat16", "float32")
    assert engine_config_from_parameters({}).cpu_compile is True  # served on CPU: compiled forwards
    assert engine_config_from_parameters({"disable_cpu_compile": "true"}).cpu_compile is False
    cached = engine_config_from_parameters({"compile_cache_dir": "/abs/cache"})
    assert cached.compile_cache_path == Path("/abs/cache")
    assert engine_config_from_parameters({}).compile_cache_path == Path.home() / ".cache/specserve/compiled"
    assert engine_config_from_parameters({}).compiled_steps == "auto"
    assert engine_config_from_parameters({"compiled_steps": "always"}).compiled_steps == "always"
    assert engine_config_from_parameters({}).step_matmul == "auto"
    assert engine_config_from_parameters({"step_matmul": "inductor"}).step_matmul == "inductor"


@pytest.mark.parametrize(
    ("params", "field"),
    [({"max_batch_size": "x"}, "max_batch_size"), ({"algorithm": "magic"}, "algorithm"),
     ({"num_steps": "two"}, "num_steps"), ({"dtype": "int8"}, "dtype"), ({"typo_key": "1"}, "typo_key"),
     ({"attention_backend": "xformers"}, "attention_backend"), ({"disable_cuda_graph": "maybe"}, "disable_cuda_graph"),
     ({"step_matmul": "blas"}, "step_matmul"),
     ({"cuda_graph_max_bs": "-1"}, "cuda_graph_max_bs"), ({"disable_by_batch_size": "-2"}, "disable_by_batch_size"),
     ({"adaptive": "sometimes"}, "adaptive"), ({"disable_cpu_compile": "maybe"}, "disable_cpu_compile"),
     ({"compiled_steps": "never"}, "compiled_steps")],
)
def test_engine_config_errors(params, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        engine_config_from_parameters(params)


def test_request_limits_from_parameters():
    assert request_limits_from_parameters(
        {"max_seq_len": "512", "default_max_tokens": "", "apply_chat_template": "1"}
    ) == (
        RequestLimits(max_seq_len=512, default_max_tokens=128, apply_chat_template=True)
    )
    with pytest.raises(ValueError, match="apply_chat_template"):
        request_limits_from_parameters({"apply_chat_template": "sometimes"})


def test_model_parameters():
    assert model_parameters({"parameters": {"a": {"string_value": "1"}}}) == {"a": "1"}
    assert model_parameters({}) == {}


# ---- the repository's configs agree with the contract ---------------------------------------


def _pbtxt_tensors(text: str, section: str) -> dict[str, str]:
    block = re.search(rf"^{section} \[(.*?)^\]", text, re.S | re.M).group(1)
    return {m.group(1): m.group(2) for m in re.finditer(r'name: "(\w+)"\s*data_type: TYPE_(\w+)', block)}


def _triton(dtype: str) -> str:
    return "STRING" if dtype == "BYTES" else dtype


@pytest.mark.parametrize("variant", sorted(p.name[4:] for p in REPO.glob("llm_*")))
def test_configs_match_the_contract(variant):
    contract = {k: _triton(v) for k, v in CONTRACT_INPUTS.items()}
    outputs = {k: _triton(v) for k, v in OUTPUTS.items()}
    pre = (REPO / "preprocessing" / "config.pbtxt").read_text()
    llm = (REPO / f"llm_{variant}" / "config.pbtxt").read_text()
    ensemble = (REPO / f"ensemble_{variant}" / "config.pbtxt").read_text()
    assert _pbtxt_tensors(pre, "input") == contract
    assert _pbtxt_tensors(ensemble, "input") == contract
    # the llm model declares its tensors (auto_complete_config): none in its config.pbtxt
    assert "input [" not in llm and "output [" not in llm
    assert {t["name"]: t["data_type"].removeprefix("TYPE_") for t in llm_inputs()} == {
        **contract, **{k: _triton(v) for k, v in INTERNAL_INPUTS.items()}}
    assert all(t["optional"] for t in llm_inputs())
    assert {t["name"]: t["data_type"].removeprefix("TYPE_") for t in llm_outputs()} == outputs
    assert _pbtxt_tensors(ensemble, "output") == outputs
    assert f'model_name: "llm_{variant}"' in ensemble
    dims = lambda text: set(re.findall(r"dims: \[ ([^\]]*) \]", text.split("output [")[0]))  # noqa: E731
    assert {tuple(t["dims"]) for t in llm_inputs()} == {(1,), (-1,)}  # vLLM's backend format
    assert dims(ensemble) == dims(pre) == {"1, 1", "1, -1"}  # TensorRT-LLM's ensemble format
    params = dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', llm))
    engine_config_from_parameters(params)  # every parameter is known and valid
