"""Request parsing and validation of the Triton models, on numpy dicts (no Triton, no model): good and
bad requests, and the bounds checked before any work."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
from request_inputs import LIMITS, FakeTokenizer, b, error_field, f32, flag, i32, req, sp, words

from specserve.config import SamplingParams
from specserve.serving.contract import (
    MAX_SAMPLING_PARAMETERS_BYTES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    GenerateRequest,
    RequestError,
    RequestLimits,
)
from specserve.serving.parsing import (
    check_prompt_length,
    encode_request_config,
    parse_decoupled_inputs,
    parse_request,
    parse_sampling_parameters,
)

# ---- good requests --------------------------------------------------------------------------


def test_defaults():
    p = parse_request(req(), LIMITS)
    assert p.text == "Hello"
    assert p.apply_chat_template is False
    assert p.request == GenerateRequest(params=SamplingParams(max_tokens=32), stream=False, echo_text=None)


def test_trtllm_style_tensors():
    p = parse_request(
        req(
            max_tokens=i32(20), min_length=i32(5), temperature=f32(0.5), top_p=f32(0.9), top_k=i32(40),
            random_seed=np.array([7], dtype=np.uint64), stream=flag(True), exclude_input_in_output=flag(True),
            end_id=i32(2), pad_id=i32(2), beam_width=i32(1),
            stop_words=np.array([b"\n\n", b""], dtype=np.object_), bad_words=np.array([b""], dtype=np.object_),
        ),
        LIMITS,
    )
    assert p.request.params == SamplingParams(
        max_tokens=20, min_tokens=5, temperature=0.5, top_p=0.9, top_k=40, seed=7, stop=("\n\n",)
    )
    assert p.request.stream is True


def test_vllm_style_sampling_parameters():
    params = {"max_tokens": 10, "temperature": 0.7, "top_p": 0.95, "top_k": -1, "seed": 3, "stop": ["END"],
              "ignore_eos": True, "n": 1, "presence_penalty": 0.0, "skip_special_tokens": True, "logprobs": None}
    p = parse_request(req(sampling_parameters=sp(params), stream=flag(True), exclude_input_in_output=flag(True)),
                      LIMITS)
    assert p.request.params == SamplingParams(
        max_tokens=10, temperature=0.7, top_p=0.95, top_k=0, seed=3, stop=("END",), ignore_eos=True
    )


def test_penalties_from_sampling_parameters_and_tensors():
    p = parse_request(req(sampling_parameters=sp({"presence_penalty": "0.5", "frequency_penalty": 0.25,
                                                  "repetition_penalty": "1.1"})), LIMITS)
    assert (p.request.params.presence_penalty, p.request.params.frequency_penalty,
            p.request.params.repetition_penalty) == (0.5, 0.25, 1.1)
    p = parse_request(req(frequency_penalty=f32(0.3), presence_penalty=f32(-0.2), repetition_penalty=f32(1.2)), LIMITS)
    assert (p.request.params.frequency_penalty, p.request.params.presence_penalty,
            p.request.params.repetition_penalty) == (0.3, -0.2, 1.2)


def test_logprobs_are_computed_only_when_returned():
    assert parse_request(req(), LIMITS).request.params.logprobs is None
    assert parse_request(req(return_logprobs=flag(True)), LIMITS).request.params.logprobs == 0
    asked = req(sampling_parameters=sp({"logprobs": 3}), return_logprobs=flag(True))
    assert parse_request(asked, LIMITS).request.params.logprobs == 3
    not_returned = req(sampling_parameters=sp({"logprobs": 3}), return_logprobs=flag(False))
    assert parse_request(not_returned, LIMITS).request.params.logprobs is None
    assert parse_request(req(return_cumulative_logprob=flag(True)), LIMITS).request.params.logprobs == 0
    # OpenAI's chat API: logprobs is a boolean
    assert parse_request(req(sampling_parameters=sp({"logprobs": False})), LIMITS).request.params.logprobs is None


def test_openai_frontend_vllm_request_replayed():
    """What Triton's OpenAI frontend (server repo, python/openai/openai_frontend/engine/utils/triton.py,
    `_create_vllm_generate_request`) sends for a chat completion with `--backend vllm`: the
    request's non-None fields as sampling_parameters, return_logprobs, the return_num_* flags."""
    sampling = {"frequency_penalty": 0.0, "n": 1, "presence_penalty": 0.0, "temperature": 0.7, "top_p": 1.0,
                "seed": 11, "stop": ["\n\n"], "max_tokens": 16}
    inputs = {"text_input": np.array([b"<chat>"], dtype=np.object_), "stream": flag(True),
              "exclude_input_in_output": flag(True), "sampling_parameters": sp(sampling),
              "return_logprobs": flag(False), "return_num_input_tokens": flag(True),
              "return_num_output_tokens": flag(True)}
    p = parse_request(inputs, LIMITS)
    assert p.request.params == SamplingParams(max_tokens=16, temperature=0.7, seed=11, stop=("\n\n",))
    assert p.request.stream is True and p.request.echo_text is None
    older = {**sampling, "logprobs": False}  # older frontends dumped OpenAI's boolean as is
    assert parse_request({**inputs, "sampling_parameters": sp(older)}, LIMITS).request.params.logprobs is None


def test_openai_frontend_trtllm_request_replayed():
    """The same frontend's default for an ensemble or Python model (`_create_trtllm_generate_request`):
    every tensor shaped [1, 1], stop_words [1, k], the penalties as tensors."""
    inputs = {"text_input": np.array([[b"<chat>"]], dtype=np.object_), "stream": np.array([[False]]),
              "max_tokens": np.array([[16]], dtype=np.int32), "stop_words": np.array([[b"END"]], dtype=np.object_),
              "top_p": np.array([[0.9]], dtype=np.float32), "frequency_penalty": np.array([[0.5]], dtype=np.float32),
              "presence_penalty": np.array([[0.0]], dtype=np.float32), "seed": np.array([[3]], dtype=np.uint64),
              "temperature": np.array([[0.0]], dtype=np.float32),
              "return_num_input_tokens": np.array([[True]]), "return_num_output_tokens": np.array([[True]])}
    p = parse_request(inputs, LIMITS)
    assert p.request.params == SamplingParams(max_tokens=16, top_p=0.9, frequency_penalty=0.5, seed=3, stop=("END",))


def test_genai_perf_string_values():
    # genai-perf --streaming with deterministic output lengths sends numbers as strings
    p = parse_request(req(sampling_parameters=sp({"max_tokens": "24", "min_tokens": "24", "ignore_eos": "true"})),
                      LIMITS)
    assert (p.request.params.max_tokens, p.request.params.min_tokens, p.request.params.ignore_eos) == (24, 24, True)
    p = parse_request(req(sampling_parameters=sp({"temperature": "0.25", "top_p": "1", "max_tokens": "16.0"})), LIMITS)
    assert (p.request.params.temperature, p.request.params.top_p, p.request.params.max_tokens) == (0.25, 1.0, 16)


def test_min_tokens_and_min_length():
    assert parse_request(req(min_tokens=i32(4)), LIMITS).request.params.min_tokens == 4
    assert parse_request(req(min_length=i32(4)), LIMITS).request.params.min_tokens == 4
    assert parse_request(req(min_tokens=i32(4), min_length=i32(4)), LIMITS).request.params.min_tokens == 4
    assert error_field(req(min_tokens=i32(4), min_length=i32(5))) == "min_length"
    assert error_field(req(max_tokens=i32(4), min_tokens=i32(5))) == "min_tokens"
    assert error_field(req(min_tokens=i32(-1))) == "min_tokens"


def test_tensor_overrides_sampling_parameters():
    p = parse_request(req(sampling_parameters=sp({"max_tokens": "8", "temperature": 0.5}), max_tokens=i32(12)), LIMITS)
    assert (p.request.params.max_tokens, p.request.params.temperature) == (12, 0.5)


def test_exclude_input_in_output():
    assert parse_request(req(exclude_input_in_output=flag(False)), LIMITS).request.echo_text == "Hello"
    assert parse_request(req(exclude_input_in_output=flag(True)), LIMITS).request.echo_text is None
    assert parse_request(req(stream=flag(True)), LIMITS).request.echo_text is None  # absent = no echo


def test_apply_chat_template_default_and_override():
    chat = RequestLimits(apply_chat_template=True)
    assert parse_request(req(), chat).apply_chat_template is True
    assert parse_request(req(apply_chat_template=flag(False)), chat).apply_chat_template is False
    assert parse_request(req(apply_chat_template=flag(True)), LIMITS).apply_chat_template is True


def test_unicode_prompt_and_shape_1x1():
    p = parse_request({"text_input": np.array([["héllo ☃".encode()]], dtype=np.object_)}, LIMITS)
    assert p.text == "héllo ☃"


# ---- bad requests: each names its field -----------------------------------------------------


@pytest.mark.parametrize(
    ("inputs", "field"),
    [
        ({}, "text_input"),
        ({"max_tokens": i32(4)}, "text_input"),
        (req(""), "text_input"),
        ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "text_input"),
        ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, "text_input"),
        ({"text_input": np.array([3], dtype=np.int32)}, "text_input"),
        (req(max_tokens=i32(0)), "max_tokens"),
        (req(max_tokens=i32(-3)), "max_tokens"),
        (req(max_tokens=i32(256)), "max_tokens"),  # above the limit (context 256)
        (req(max_tokens=f32(4.0)), "max_tokens"),  # wrong type
        (req(max_tokens=flag(True)), "max_tokens"),
        (req(temperature=f32(-0.1)), "temperature"),
        (req(temperature=f32(float("nan"))), "temperature"),
        (req(temperature=b("hot")), "temperature"),
        (req(top_p=f32(0.0)), "top_p"),
        (req(top_p=f32(1.5)), "top_p"),
        (req(top_k=i32(-2)), "top_k"),
        (req(stream=i32(1)), "stream"),
        (req(stream=flag(True), exclude_input_in_output=flag(False)), "exclude_input_in_output"),
        (req(bad_words=np.array([b"x"], dtype=np.object_)), "bad_words"),
        (req(beam_width=i32(2)), "beam_width"),
        (req(seed=np.array([1], dtype=np.uint64), random_seed=np.array([2], dtype=np.uint64)), "random_seed"),
        (req(nonsense=i32(1)), "nonsense"),
        (req(sampling_parameters=b("{not json")), "sampling_parameters"),
        (req(sampling_parameters=b("[1, 2]")), "sampling_parameters"),
        (req(sampling_parameters=np.array([1], dtype=np.int32)), "sampling_parameters"),
        (req(sampling_parameters=sp({"max_tokens": "many"})), "sampling_parameters.max_tokens"),
        (req(sampling_parameters=sp({"max_tokens": "2.5"})), "sampling_parameters.max_tokens"),
        (req(sampling_parameters=sp({"max_tokens": True})), "sampling_parameters.max_tokens"),
        (req(sampling_parameters=sp({"max_tokens": "0"})), "max_tokens"),
        (req(sampling_parameters=sp({"max_tokens": 100000})), "max_tokens"),
        (req(sampling_parameters=sp({"temperature": "-1"})), "temperature"),
        (req(sampling_parameters=sp({"temperature": "warm"})), "sampling_parameters.temperature"),
        (req(sampling_parameters=sp({"top_p": "0"})), "top_p"),
        (req(sampling_parameters=sp({"top_p": 2})), "top_p"),
        (req(sampling_parameters=sp({"ignore_eos": "maybe"})), "sampling_parameters.ignore_eos"),
        (req(sampling_parameters=sp({"stop": 5})), "sampling_parameters.stop"),
        (req(sampling_parameters=sp({"n": 2})), "sampling_parameters.n"),
        (req(sampling_parameters=sp({"presence_penalty": "high"})), "sampling_parameters.presence_penalty"),
        (req(sampling_parameters=sp({"presence_penalty": 3})), "presence_penalty"),
        (req(frequency_penalty=f32(-2.5)), "frequency_penalty"),
        (req(repetition_penalty=f32(0.0)), "repetition_penalty"),
        (req(sampling_parameters=sp({"logprobs": 21})), "sampling_parameters.logprobs"),
        (req(return_logprobs=i32(1)), "return_logprobs"),
        (req(sampling_parameters=sp({"wat": 1})), "sampling_parameters.wat"),
        (req(sampling_parameters=sp({"seed": -1})), "seed"),
    ],
)
def test_bad_input_names_the_field(inputs, field):
    assert error_field(inputs) == field


def test_default_max_tokens_is_capped_by_the_context():
    p = parse_request(req(), RequestLimits(max_seq_len=64, default_max_tokens=128))
    assert p.request.params.max_tokens == 63


def test_empty_sampling_parameters_is_fine():
    assert parse_request(req(sampling_parameters=b("")), LIMITS).request.params.max_tokens == 32
    assert parse_request(req(sampling_parameters=sp({})), LIMITS).request.params.max_tokens == 32


def test_prompt_length():
    check_prompt_length(list(range(255)), LIMITS)
    with pytest.raises(RequestError, match=r"^text_input: the prompt is 256 tokens"):
        check_prompt_length(list(range(256)), LIMITS)
    with pytest.raises(RequestError, match=r"^text_input"):
        check_prompt_length([], LIMITS)


# ---- bounds, checked before any work ----------------------------------------------------------


def test_the_prompt_bound_leaves_room_for_the_longest_tokens():
    """A prompt of max_seq_len - 1 tokens of the longest SmolLM2 token (a newline and 80 spaces) fits."""
    assert LIMITS.max_prompt_bytes >= (LIMITS.max_seq_len - 1) * 81
    assert RequestLimits().max_prompt_bytes == 2048 * 256


def test_text_input_bytes_are_bounded_before_decoding():
    n = LIMITS.max_prompt_bytes
    assert len(parse_request(req(" " * n), LIMITS).text) == n
    with pytest.raises(RequestError, match=rf"^text_input: {n + 1} bytes, more than the {n} allowed"):
        parse_request(req(" " * (n + 1)), LIMITS)
    invalid = {"text_input": np.array([b"\xff" * (n + 1)], dtype=np.object_)}  # refused by size, not decoded
    with pytest.raises(RequestError, match=r"^text_input: \d+ bytes"):
        parse_request(invalid, LIMITS)


@pytest.mark.parametrize("parse", [
    lambda inputs: parse_request(inputs, LIMITS),
    lambda inputs: parse_decoupled_inputs(inputs, LIMITS, FakeTokenizer()),
], ids=["preprocessing", "decoupled"])
def test_a_100_mb_prompt_is_refused_at_once(parse):
    inputs = req(sampling_parameters=sp({"max_tokens": 4}))
    inputs["text_input"] = np.array([b"x" * 100_000_000], dtype=np.object_)
    start = time.perf_counter()
    with pytest.raises(RequestError, match=r"^text_input: 100000000 bytes"):
        parse(inputs)
    assert time.perf_counter() - start < 0.5


def test_sampling_parameters_bytes_are_bounded():
    n = MAX_SAMPLING_PARAMETERS_BYTES
    body = json.dumps({"max_tokens": 4})
    padded = body + " " * (n - len(body))
    assert len(padded) == n and parse_sampling_parameters(padded.encode()) == {"max_tokens": 4}
    with pytest.raises(RequestError, match=rf"^sampling_parameters: {n + 1} bytes, more than the {n} "):
        parse_sampling_parameters((padded + " ").encode())
    widest = {"stop": ["\U0001f600" * MAX_STOP_CHARS] * MAX_STOP_STRINGS, "seed": 2**64 - 1, "top_p": 0.5}
    assert len(json.dumps(widest)) < n  # the largest valid stop strings fit


def test_input_ids_are_counted_before_they_are_copied():
    config_tensor = encode_request_config(GenerateRequest(SamplingParams(max_tokens=4)))
    huge = np.broadcast_to(np.int32(1), (10**12,))  # a view: copying it would take terabytes
    with pytest.raises(RequestError, match=r"^input_ids: 1000000000000 ids"):
        parse_decoupled_inputs({"input_ids": huge, "request_config": config_tensor}, LIMITS, FakeTokenizer())
    most = {"input_ids": np.ones(255, dtype=np.int32), "request_config": config_tensor}
    ids, _ = parse_decoupled_inputs(most, LIMITS, FakeTokenizer())
    assert len(ids) == 255


@pytest.mark.parametrize("name", ["stop_words", "bad_words"])
def test_list_tensors_are_counted_before_they_are_read(name):
    entries = np.broadcast_to(np.array([b"x"], dtype=np.object_), (10**9,))  # a view of one entry
    start = time.perf_counter()
    with pytest.raises(RequestError, match=rf"^{name}: at most {MAX_STOP_STRINGS} entries, got 1000000000"):
        parse_request(req(**{name: entries}), LIMITS)
    assert time.perf_counter() - start < 0.5


def test_stop_strings_within_the_bounds_are_accepted():
    def stop(inputs: dict[str, np.ndarray]) -> tuple[str, ...]:
        return parse_request(inputs, LIMITS).request.params.stop

    most = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    assert stop(req(stop_words=words(*(s.encode() for s in most)))) == tuple(most)
    assert stop(req(sampling_parameters=sp({"stop": most}))) == tuple(most)
    longest = "é" * MAX_STOP_CHARS  # characters are counted, not bytes
    assert stop(req(stop_words=words(longest.encode()))) == (longest,)
    assert stop(req(sampling_parameters=sp({"stop": longest}))) == (longest,)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (req(stop_words=words(*[b"s"] * (MAX_STOP_STRINGS + 1))), "stop_words: at most 16 entries, got 17"),
        (req(stop_words=words(b"s" * (MAX_STOP_CHARS + 1))),
         "stop_words: a stop string is at most 256 characters, got 257"),
        (req(stop_words=words(b"\xff" * 2000)), "stop_words: 2000 bytes, more than the 1024 allowed"),
        (req(sampling_parameters=sp({"stop": ["s"] * (MAX_STOP_STRINGS + 1)})),
         "sampling_parameters.stop: at most 16 stop strings, got 17"),
        (req(sampling_parameters=sp({"stop": "s" * (MAX_STOP_CHARS + 1)})),
         "sampling_parameters.stop: a stop string is at most 256 characters, got 257"),
        (req(sampling_parameters=sp({"stop": ["a", "s" * (MAX_STOP_CHARS + 1)]})),
         "sampling_parameters.stop: a stop string is at most 256 characters"),
        (req(bad_words=words(b"s" * 300)), "bad_words: not supported"),
    ],
)
def test_stop_strings_beyond_the_bounds_are_refused(inputs, message):
    with pytest.raises(RequestError, match=f"^{re.escape(message)}"):
        parse_request(inputs, LIMITS)


@pytest.mark.parametrize(
    "raw",
    [
        "[" * 50_000,
        '{"a":' * 10_000,
        '{"stop": ' + "[" * 30_000 + "]" * 30_000 + "}",
        '{"temperature": ' + "[" * 30_000,
    ],
)
def test_too_deeply_nested_sampling_parameters_are_refused(raw):
    with pytest.raises(RequestError, match=r"^sampling_parameters: nested too deeply$"):
        parse_request(req(sampling_parameters=b(raw)), LIMITS)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ("[" * 100_000, "sampling_parameters"),  # over the byte bound: never parsed
        ('{"stop": ' + "[" * 900 + "]" * 900 + "}", "sampling_parameters.stop"),  # nested, within the limit
        ('{"max_tokens": ' + "9" * 5000 + "}", "sampling_parameters"),  # more digits than Python converts
        ('{"temperature": ' + "9" * 400 + "}", "sampling_parameters.temperature"),  # no float is that large
        ('{"temperature": 1e999}', "temperature"),  # infinity
        ('{"temperature": NaN}', "temperature"),
        ('{"top_k": "' + "9" * 5000 + '"}', "sampling_parameters.top_k"),
        ('{"cache_salt": 5}', "sampling_parameters.cache_salt"),
        ('{"cache_salt": ""}', "cache_salt"),
        ('{"cache_salt": "' + "s" * 257 + '"}', "cache_salt"),
    ],
)
def test_adversarial_sampling_parameters_are_refused_naming_the_field(raw, field):
    assert error_field(req(sampling_parameters=b(raw))) == field


def test_error_messages_show_a_client_value_cut_short():
    with pytest.raises(RequestError) as e:
        parse_request(req(sampling_parameters=sp({"top_k": "x" * 60_000})), LIMITS)
    assert len(str(e.value)) < 200


@pytest.mark.parametrize(
    "inputs",
    [
        req(temperature=f32(1e-30)),
        req(sampling_parameters=sp({"temperature": 1e-40})),
        req(sampling_parameters=sp({"temperature": "5e-324"})),
    ],
)
def test_a_temperature_below_1e_5_decodes_greedily(inputs):
    params = parse_request(inputs, LIMITS).request.params
    assert params.temperature == 0.0 and params.greedy


def test_cache_salt_is_parsed_and_carried_to_the_decoupled_model():
    parsed = parse_request(req(sampling_parameters=sp({"cache_salt": "tenant-a", "max_tokens": 4})), LIMITS)
    assert parsed.request.params.cache_salt == "tenant-a"
    unsalted = parse_request(req(sampling_parameters=sp({"cache_salt": None})), LIMITS).request
    assert unsalted.params.cache_salt is None
    assert parse_request(req(), LIMITS).request.params.cache_salt is None
    inputs = {"input_ids": np.array([5, 6], dtype=np.int32),
              "request_config": encode_request_config(parsed.request)}
    _, request = parse_decoupled_inputs(inputs, LIMITS, FakeTokenizer())
    assert request.params.cache_salt == "tenant-a"
