"""Request parsing for the Triton models, on plain dicts of numpy arrays.

Nothing here imports Triton, so every rule is unit-testable. The Python models hand in
`{name: np.ndarray}` (what `request.inputs()` holds) and get back a `ParsedRequest` or a
`RequestError` whose message starts with the offending field, e.g. ``max_tokens: must be ...``.
A scalar tensor overrides the same key in `sampling_parameters`. Sizes are bounded before any
work (`RequestLimits`): a too large input costs a length check. The contract itself (names, types,
outputs, bounds) is `contract`; config.pbtxt parameters are `parameters`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from specserve.config import SamplingParams
from specserve.grammar import GrammarSpec, from_trtllm, from_vllm
from specserve.knobs import shown
from specserve.serving.contract import (
    CONTRACT_INPUTS,
    INTERNAL_INPUTS,
    MAX_LOGPROBS,
    MAX_SAMPLING_PARAMETERS_BYTES,
    GenerateRequest,
    ParsedRequest,
    RequestError,
    RequestLimits,
)
from specserve.serving.tokenizer import Tokenizer
from specserve.serving.values import (
    check_bytes,
    json_loads,
    json_text,
    stop_strings,
    tensor_bool,
    tensor_float,
    tensor_int,
    tensor_strings,
    tensor_value,
    utf8_text,
)

# ---- sampling_parameters (vLLM style JSON; genai-perf sends numbers as strings) --------------


def _json_int(key: str, v: Any) -> int:
    if isinstance(v, bool):
        raise RequestError(f"sampling_parameters.{key}: expected an integer, got {shown(v)}")
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            try:
                f = float(v)
            except ValueError:
                f = math.nan
            if f.is_integer():
                return int(f)
    raise RequestError(f"sampling_parameters.{key}: expected an integer, got {shown(v)}")


def _json_float(key: str, v: Any) -> float:
    if isinstance(v, bool):
        raise RequestError(f"sampling_parameters.{key}: expected a number, got {v!r}")
    try:
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, str):
            return float(v.strip())
    except OverflowError:
        raise RequestError(f"sampling_parameters.{key}: out of range, got {shown(v)}") from None
    except ValueError:
        pass
    raise RequestError(f"sampling_parameters.{key}: expected a number, got {shown(v)}")


def _json_bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0"):
        return v.strip().lower() in ("true", "1")
    raise RequestError(f"sampling_parameters.{key}: expected a boolean, got {shown(v)}")


def _json_stop(key: str, v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return stop_strings([s for s in v if s], f"sampling_parameters.{key}")
    raise RequestError(f"sampling_parameters.{key}: expected a string or a list of strings, got {shown(v)}")


def _json_str(key: str, v: Any) -> str:
    if isinstance(v, str):
        return v
    raise RequestError(f"sampling_parameters.{key}: expected a string, got {shown(v)}")


def _json_logprobs(key: str, v: Any) -> int | None:
    """vLLM: the number of top alternatives per token (0 = the chosen token's only); OpenAI's
    chat API sends a boolean (true = 0 alternatives), false = none."""
    if isinstance(v, bool):
        return 0 if v else None
    n = _json_int(key, v)
    if not 0 <= n <= MAX_LOGPROBS:
        raise RequestError(f"sampling_parameters.{key}: must be in [0, {MAX_LOGPROBS}], got {n}")
    return n


_JSON_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "max_tokens": _json_int,
    "min_tokens": _json_int,
    "temperature": _json_float,
    "top_p": _json_float,
    "top_k": _json_int,
    "seed": _json_int,
    "ignore_eos": _json_bool,
    "stop": _json_stop,
    "presence_penalty": _json_float,
    "frequency_penalty": _json_float,
    "repetition_penalty": _json_float,
    "logprobs": _json_logprobs,
    "cache_salt": _json_str,  # vLLM's: requests with different salts share no cached prefix
}
# vLLM's constraint object, under its name and its older one
STRUCTURED_OUTPUT_KEYS = ("structured_outputs", "guided_decoding")
# vLLM keys we accept only at their default (the engine has no such feature).
_JSON_DEFAULT_ONLY: dict[str, Any] = {
    "n": 1,
    "best_of": 1,
    "min_p": 0.0,
    "use_beam_search": False,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
}


def parse_sampling_parameters(raw: Any) -> dict[str, Any]:
    """vLLM's `sampling_parameters` JSON (at most MAX_SAMPLING_PARAMETERS_BYTES) -> SamplingParams
    keyword arguments (validated later)."""
    text = json_text(raw, "sampling_parameters", MAX_SAMPLING_PARAMETERS_BYTES)
    if not text.strip():
        return {}
    obj = json_loads(text, "sampling_parameters")
    if not isinstance(obj, dict):
        raise RequestError(f"sampling_parameters: expected a JSON object, got {type(obj).__name__}")
    try:
        return _sampling_kwargs(obj)
    except RecursionError:  # a value too deeply nested to show in a message
        raise RequestError("sampling_parameters: nested too deeply") from None


def _sampling_kwargs(obj: dict[str, Any]) -> dict[str, Any]:
    """The `sampling_parameters` object's keys converted (`_JSON_FIELDS`) or checked at their default."""
    kwargs: dict[str, Any] = {}
    for key, value in obj.items():
        if value is None:
            continue
        if key in STRUCTURED_OUTPUT_KEYS:
            if "structured_output" in kwargs:
                raise RequestError(f"sampling_parameters.{key}: give structured_outputs or guided_decoding, not both")
            kwargs["structured_output"] = _grammar(from_vllm, value, f"sampling_parameters.{key}")
        elif key in _JSON_FIELDS:
            kwargs[key] = _JSON_FIELDS[key](key, value)
        elif key in _JSON_DEFAULT_ONLY:
            default = _JSON_DEFAULT_ONLY[key]
            convert = _json_bool if isinstance(default, bool) else _json_float
            if convert(key, value) != default:
                raise RequestError(f"sampling_parameters.{key}: only {json.dumps(default)} is supported")
        else:
            raise RequestError(f"sampling_parameters.{key}: unknown parameter")
    if kwargs.get("top_k") == -1:  # vLLM's "disabled"
        kwargs["top_k"] = 0
    if "logprobs" in kwargs and kwargs["logprobs"] is None:
        del kwargs["logprobs"]
    return kwargs


# ---- the whole request ----------------------------------------------------------------------


def _tensor_overrides(inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """TRT-LLM-style scalar tensors -> SamplingParams keyword arguments."""
    kw: dict[str, Any] = {}
    for name in ("max_tokens", "top_k"):
        if (v := tensor_int(inputs, name)) is not None:
            kw[name] = v
    min_tokens, min_length = tensor_int(inputs, "min_tokens"), tensor_int(inputs, "min_length")
    if min_tokens is not None and min_length is not None and min_tokens != min_length:
        raise RequestError(f"min_length: {min_length} conflicts with min_tokens {min_tokens}")
    if (v := min_tokens if min_tokens is not None else min_length) is not None:
        kw["min_tokens"] = v
    for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if (v := tensor_float(inputs, name)) is not None:
            kw[name] = v
    seed, random_seed = tensor_int(inputs, "seed"), tensor_int(inputs, "random_seed")
    if seed is not None and random_seed is not None and seed != random_seed:
        raise RequestError(f"random_seed: {random_seed} conflicts with seed {seed}")
    if (v := seed if seed is not None else random_seed) is not None:
        kw["seed"] = v
    if (v := tensor_bool(inputs, "ignore_eos")) is not None:
        kw["ignore_eos"] = v
    if stop := tensor_strings(inputs, "stop_words"):
        kw["stop"] = stop_strings(stop, "stop_words")
    guide_type = tensor_value(inputs, "guided_decoding_guide_type")
    guide = tensor_value(inputs, "guided_decoding_guide")
    if guide_type is not None or guide is not None:
        check_bytes(guide_type, "guided_decoding_guide_type", 64)
        check_bytes(guide, "guided_decoding_guide", MAX_SAMPLING_PARAMETERS_BYTES)
        kind = utf8_text(guide_type, "guided_decoding_guide_type") if guide_type is not None else ""
        text = utf8_text(guide, "guided_decoding_guide") if guide is not None else None
        if spec := _grammar(from_trtllm, kind, text):
            kw["structured_output"] = spec
    return kw


def _grammar(form: Callable[..., GrammarSpec | None], *args: Any) -> GrammarSpec | None:
    """`form(*args)`: a request form's `GrammarSpec` (`specserve.grammar`), its ValueError as the client's error."""
    try:
        return form(*args)
    except ValueError as e:
        raise RequestError(str(e)) from None


def _check_unsupported(inputs: Mapping[str, np.ndarray]) -> None:
    if tensor_strings(inputs, "bad_words"):
        raise RequestError("bad_words: not supported")
    if (beam := tensor_int(inputs, "beam_width")) is not None and beam != 1:
        raise RequestError(f"beam_width: only 1 is supported, got {beam}")
    for name in ("end_id", "pad_id"):
        tensor_int(inputs, name)  # type-checked, otherwise ignored
    for name in ("return_num_input_tokens", "return_num_output_tokens", "return_finish_reason", "return_perf_metrics"):
        tensor_bool(inputs, name)


def _check_max_tokens(max_tokens: Any, limits: RequestLimits) -> None:
    if isinstance(max_tokens, int) and max_tokens > limits.max_tokens_limit:
        raise RequestError(
            f"max_tokens: must be <= {limits.max_tokens_limit} (the context is {limits.max_seq_len} tokens), "
            f"got {max_tokens}"
        )


def _sampling_params(kwargs: Mapping[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:  # SamplingParams names the field first
        raise RequestError(str(e)) from None


def build_sampling_params(kwargs: Mapping[str, Any], limits: RequestLimits) -> SamplingParams:
    default = min(limits.default_max_tokens, limits.max_tokens_limit)  # a default never fails
    kw = {"max_tokens": default, **kwargs}
    _check_max_tokens(kw["max_tokens"], limits)
    return _sampling_params(kw)


def parse_request(inputs: Mapping[str, np.ndarray], limits: RequestLimits) -> ParsedRequest:
    """Validate the contract inputs of one request (everything but the prompt's token count)."""
    unknown = sorted(set(inputs) - set(CONTRACT_INPUTS))
    if unknown:
        raise RequestError(f"{unknown[0]}: unknown input")
    raw_text = tensor_value(inputs, "text_input")
    if raw_text is None:
        raise RequestError("text_input: missing")
    check_bytes(raw_text, "text_input", limits.max_prompt_bytes,
                 f" (a prompt that fits the context of {limits.max_seq_len} tokens is shorter)")
    text = utf8_text(raw_text, "text_input")
    if not text:
        raise RequestError("text_input: is empty")
    _check_unsupported(inputs)

    kwargs: dict[str, Any] = {}
    if "sampling_parameters" in inputs:
        kwargs.update(parse_sampling_parameters(tensor_value(inputs, "sampling_parameters")))
    overrides = _tensor_overrides(inputs)
    if "structured_output" in kwargs and "structured_output" in overrides:
        raise RequestError("guided_decoding_guide_type: conflicts with sampling_parameters.structured_outputs")
    kwargs.update(overrides)
    # vLLM's backend returns logprobs only with return_logprobs; cumulative_logprob needs them computed
    if tensor_bool(inputs, "return_logprobs") or tensor_bool(inputs, "return_cumulative_logprob"):
        kwargs.setdefault("logprobs", 0)
    elif "logprobs" in kwargs and "return_logprobs" in inputs:
        del kwargs["logprobs"]  # asked for in sampling_parameters, but return_logprobs=false
    params = build_sampling_params(kwargs, limits)

    stream = bool(tensor_bool(inputs, "stream"))
    exclude = tensor_bool(inputs, "exclude_input_in_output")  # absent = do not echo (as vLLM's backend)
    if stream and exclude is False:
        raise RequestError("exclude_input_in_output: must be true when streaming (stream=true)")
    chat = tensor_bool(inputs, "apply_chat_template")
    return ParsedRequest(
        text=text,
        apply_chat_template=limits.apply_chat_template if chat is None else chat,
        request=GenerateRequest(params=params, stream=stream, echo_text=text if exclude is False else None),
    )


def check_prompt_length(prompt_ids: list[int], limits: RequestLimits) -> None:
    if not prompt_ids:
        raise RequestError("text_input: tokenizes to no tokens")
    if len(prompt_ids) >= limits.max_seq_len:
        raise RequestError(
            f"text_input: the prompt is {len(prompt_ids)} tokens; it must be shorter than the "
            f"context of {limits.max_seq_len} tokens"
        )


# ---- preprocessing -> llm ---------------------------------------------------------------


def encode_request_config(request: GenerateRequest) -> np.ndarray:
    """The BYTES [1] tensor `request_config` preprocessing hands to the decoupled model."""
    payload = {
        "params": dataclasses.asdict(request.params),
        "stream": request.stream,
        "echo_text": request.echo_text,
    }
    return np.array([json.dumps(payload).encode("utf-8")], dtype=np.object_)


_REQUEST_CONFIG_KEYS = frozenset({"params", "stream", "echo_text"})
_PARAMS_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def decode_request_config(raw: Any, limits: RequestLimits) -> GenerateRequest:
    """`request_config` -> the request, checked as strictly as a client's: any client may send it.

    At most `limits.max_request_config_bytes`, exactly the keys `encode_request_config` writes,
    the same bounds as the contract path (stop strings, max_tokens)."""
    payload = json_loads(json_text(raw, "request_config", limits.max_request_config_bytes), "request_config")
    try:
        return _request_from_config(payload, limits)
    except RecursionError:  # a value too deeply nested to show in a message
        raise RequestError("request_config: nested too deeply") from None


def _request_from_config(payload: Any, limits: RequestLimits) -> GenerateRequest:
    if not isinstance(payload, dict):
        raise RequestError(f"request_config: expected a JSON object, got {type(payload).__name__}")
    if unknown := sorted(set(payload) - _REQUEST_CONFIG_KEYS):
        raise RequestError(f"request_config.{unknown[0]}: unknown key")
    for key in ("params", "stream"):
        if key not in payload:
            raise RequestError(f"request_config.{key}: missing")
    stream, echo_text = payload["stream"], payload.get("echo_text")
    if not isinstance(stream, bool):
        raise RequestError(f"request_config.stream: expected a boolean, got {shown(stream)}")
    if echo_text is not None and not isinstance(echo_text, str):
        raise RequestError(f"request_config.echo_text: expected a string or null, got {shown(echo_text)}")
    params = _params_from_config(payload["params"], limits)
    return GenerateRequest(params=params, stream=stream, echo_text=echo_text)


def _params_from_config(params: Any, limits: RequestLimits) -> SamplingParams:
    """`request_config.params` (SamplingParams as JSON) -> SamplingParams."""
    if not isinstance(params, dict):
        raise RequestError(f"request_config.params: expected a JSON object, got {type(params).__name__}")
    if unknown := sorted(set(params) - _PARAMS_FIELDS):
        raise RequestError(f"request_config.params.{unknown[0]}: unknown parameter")
    kw = dict(params)
    if kw.get("structured_output") is not None:
        kw["structured_output"] = _grammar(GrammarSpec.from_dict, kw["structured_output"],
                                           "request_config.params.structured_output")
    if "stop" in kw:
        stop = kw["stop"]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RequestError(f"request_config.params.stop: expected a list of strings, got {shown(stop)}")
        kw["stop"] = stop_strings(stop, "request_config.params.stop")
    sampling = _sampling_params(kw)
    _check_max_tokens(sampling.max_tokens, limits)
    return sampling


def parse_prompt_ids(inputs: Mapping[str, np.ndarray], limits: RequestLimits) -> list[int]:
    """`input_ids` (INT32 [-1]): fewer than max_seq_len ids, counted before they are copied."""
    ids = np.asarray(inputs["input_ids"])
    if not np.issubdtype(ids.dtype, np.integer):
        raise RequestError(f"input_ids: expected INT32, got {ids.dtype}")
    if ids.size == 0:
        raise RequestError("input_ids: is empty")
    if ids.size >= limits.max_seq_len:
        raise RequestError(f"input_ids: {ids.size} ids; the prompt must be shorter than the context of "
                           f"{limits.max_seq_len} tokens")
    return ids.reshape(-1).astype(np.int64).tolist()


def parse_decoupled_inputs(
    inputs: Mapping[str, np.ndarray], limits: RequestLimits, tokenizer: Tokenizer
) -> tuple[list[int], GenerateRequest]:
    """The decoupled model's inputs: the client contract itself (a client calling `llm_<variant>`),
    or `input_ids` + `request_config` from preprocessing (the ensemble `ensemble_<variant>`)."""
    internal = set(INTERNAL_INPUTS) & set(inputs)
    if internal:
        if internal != set(INTERNAL_INPUTS) or len(inputs) != len(INTERNAL_INPUTS):
            raise RequestError(
                "input_ids: send either input_ids with request_config (as preprocessing does) "
                "or the text_input contract, not a mix"
            )
        prompt_ids = parse_prompt_ids(inputs, limits)
        request = decode_request_config(tensor_value(inputs, "request_config"), limits)
    else:
        parsed = parse_request(inputs, limits)
        prompt_ids = tokenizer.encode(parsed.text, parsed.apply_chat_template)
        request = parsed.request
    check_prompt_length(prompt_ids, limits)
    return prompt_ids, request
