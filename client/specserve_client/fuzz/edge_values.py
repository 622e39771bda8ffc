"""The categories of edge values: `sampling_parameters` JSON with any keys and edge values (`Huge`,
`json_pieces`: long strings kept short in the summary), scalar tensors at their type's edges, and
`input_ids` + `request_config` forged and sent to `llm_<variant>` directly.

It holds no category that breaks a request's form (`malformed`) nor the edge grid (`drawing`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from specserve_client.fuzz.blocks import (
    broken_base,
    element,
    family_and_model,
    forged_payload,
    max_tokens,
    request_of,
    shape_for,
    tensor,
)
from specserve_client.fuzz.contract import (
    CONTRACT_INPUTS,
    DEFAULT_ONLY_KEYS,
    INPUTS,
    INT32_MAX,
    INT32_MIN,
    MAX_TOKENS,
    PARAMS_BASE,
    SAMPLING_KEYS,
    VOCAB_SIZE,
    FuzzRequest,
    Long,
    TensorSpec,
)
from specserve_client.fuzz.malformed import depths, nesting


@dataclass(frozen=True)
class Huge:
    """A JSON string of `times` x's, written as a Long (so the summary stays short)."""

    times: int


JSON_EDGES = [math.nan, math.inf, -math.inf, -1, 0, 1, 8, 1e-40, 2**64, 2**63, -(2**63), 2**31, 5.5, 1.5,
              0.5, -0.0, 1e308, True, False, None, [], [1, 2], ["a"], [None], {}, {"a": 1}, "", " ", "1",
              " 8 ", "8.0", "nan", "inf", "-inf", "true", "1e309", "0x10", "\u0663", "1_000", Huge(10_000),
              Huge(1_000_000)]


def json_edge_values() -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(JSON_EDGES), st.integers(), st.floats(), st.text(max_size=12),
                     st.lists(st.text(max_size=6), max_size=40), st.booleans())


def without_huge(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return values.filter(lambda v: not isinstance(v, Huge))


def safe_json_max_tokens() -> st.SearchStrategy[Any]:
    """max_tokens in sampling_parameters, of any type, none valid above MAX_TOKENS (never null: the
    server would take its default)."""
    n = max_tokens()
    invalid = st.sampled_from([0, -1, 2**20, 2**64, 1.5, "x", True, [], {}, "nan", math.inf])
    return st.one_of(n, n.map(float), n.map(str), n.map(lambda k: f" {k} "), invalid)


def json_pieces(obj: Any) -> Long | bytes:
    """`obj` as JSON bytes; its Huge strings as repeated pieces."""
    huge: list[Huge] = []

    def mark(value: Any) -> Any:
        if isinstance(value, Huge):
            huge.append(value)
            return f"@@huge{len(huge) - 1}@@"
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    text = json.dumps(mark(obj)).encode("utf-8")
    if not huge:
        return text
    parts: list[tuple[bytes, int]] = []
    for i, h in enumerate(huge):
        before, text = text.split(f"@@huge{i}@@".encode(), 1)
        parts += [(before, 1), (b"x", h.times)]
    return Long((*parts, (text, 1)))


UNKNOWN_KEYS = ("max_new_tokens", "Temperature", "temperature ", "", "stop_token_ids", "guided_json",
                "prompt", "\u00e9", "lora_request")


@st.composite
def sampling_json(draw: st.DrawFn, variants: tuple[str, ...]) -> FuzzRequest:
    """sampling_parameters with 1-4 keys of any kind and edge values; max_tokens kept at most
    MAX_TOKENS by the scalar tensor (which overrides the key) or by the key itself."""
    family, model, inputs = draw(broken_base(variants))
    keys = st.one_of(st.sampled_from(SAMPLING_KEYS + DEFAULT_ONLY_KEYS), st.sampled_from(UNKNOWN_KEYS),
                     st.text(max_size=10))
    obj = draw(st.dictionaries(keys, json_edge_values(), min_size=1, max_size=4))
    if draw(st.booleans()):  # no scalar tensor: the key alone bounds the answer
        del inputs["max_tokens"]
        obj["max_tokens"] = draw(safe_json_max_tokens())
    inputs["sampling_parameters"] = TensorSpec("sampling_parameters", "BYTES",
                                               shape_for("sampling_parameters", family), (json_pieces(obj),))
    return request_of("sampling_json", model, inputs)


FP32_EDGES = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-40, 1e-6, 1e-5, 2e-5, 0.1, 0.5, 1.0, 2.0,
              2.0000002, -2.0, -2.0000002, -1.0, 65504.0, 3.4e38, -3.4e38]
INT32_EDGES = [INT32_MIN, -1, 0, 1, 2, 5, 8, 9, 20, 21, VOCAB_SIZE - 1, VOCAB_SIZE, INT32_MAX]


def scalar_edges(name: str) -> st.SearchStrategy[Any]:
    """Edge values of a scalar input in its own datatype (max_tokens: none valid above MAX_TOKENS)."""
    datatype = INPUTS[name]
    if name == "max_tokens":
        return st.sampled_from([INT32_MIN, -1, 0, 1, MAX_TOKENS, 2**20, INT32_MAX])
    if datatype == "INT32":
        return st.one_of(st.sampled_from(INT32_EDGES), element("INT32"))
    if datatype == "FP32":
        return st.one_of(st.sampled_from(FP32_EDGES), element("FP32"))
    if datatype == "UINT64":
        return st.one_of(st.sampled_from([0, 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]), element("UINT64"))
    return element(datatype)


SCALARS = tuple(n for n, d in CONTRACT_INPUTS.items() if d != "BYTES")


@st.composite
def scalar_values(draw: st.DrawFn, variants: tuple[str, ...]) -> FuzzRequest:
    family, model, inputs = draw(broken_base(variants))
    for name in draw(st.lists(st.sampled_from(SCALARS), min_size=1, max_size=4, unique=True)):
        inputs[name] = tensor(name, draw(scalar_edges(name)), family)
    return request_of("scalars", model, inputs)


FORGED_WRONG = [None, True, False, "5", "", [], {}, [1], math.nan, math.inf, -math.inf, 5.5, 1.5, -1,
                2**64, -(2**63), 1e-40, "x" * 300]
FORGED_MAX_TOKENS = [0, -1, 1, MAX_TOKENS, 8.0, "8", True, None, 2**20, 2**31, 2**64, 1.5, math.nan, []]
FORGED_STOPS = [["x"] * 3000, [1, 2], [None], "abc", [""], [["a"]]]


def forged_field_values(name: str) -> st.SearchStrategy[Any]:
    """A value of request_config's params: wrong types and edges (max_tokens: none valid above
    MAX_TOKENS)."""
    if name == "max_tokens":
        return st.sampled_from(FORGED_MAX_TOKENS)
    wrong = st.sampled_from(FORGED_WRONG)
    if name == "stop":
        return st.one_of(wrong, st.sampled_from(FORGED_STOPS))
    return st.one_of(wrong, without_huge(json_edge_values()), element("FP64"))


FORGED_MUTATIONS = ("field", "unknown_field", "missing_field", "params_not_object", "payload_not_object",
                    "not_json", "nested", "top_level", "none")
NOT_JSON = [b"", b"{", b"{'params': {}}", b"NaN", b"\xff\xfe", b'{"params": {"max_tokens": 4}']


@st.composite
def forged_config(draw: st.DrawFn) -> bytes | Long:
    """request_config as preprocessing never writes it: 1-3 mutations of a valid one."""
    payload: Any = forged_payload({"max_tokens": draw(max_tokens())})
    for mutation in draw(st.lists(st.sampled_from(FORGED_MUTATIONS), min_size=1, max_size=3)):
        payload = draw(forged_mutation(payload, mutation))
        if not isinstance(payload, dict):
            break
    return payload if isinstance(payload, (bytes, Long)) else json.dumps(payload).encode("utf-8")


@st.composite
def typed_config(draw: st.DrawFn) -> bytes:
    """request_config whose structure is sound and 1-3 params fields have wrong types or edge values."""
    params: dict[str, Any] = {"max_tokens": draw(max_tokens())}
    for name in draw(st.lists(st.sampled_from(sorted(PARAMS_BASE)), min_size=1, max_size=3, unique=True)):
        params[name] = draw(forged_field_values(name))
    return json.dumps(forged_payload(params)).encode("utf-8")


@st.composite
def forged_mutation(draw: st.DrawFn, payload: dict[str, Any], mutation: str) -> Any:
    """The payload changed by one mutation (a payload no longer an object ends the mutations)."""
    params = dict(payload["params"]) if isinstance(payload.get("params"), dict) else None
    if mutation == "params_not_object":
        return payload | {"params": draw(st.sampled_from([None, [], "params", 5, [["max_tokens", 4]]]))}
    if mutation == "payload_not_object":
        return draw(st.sampled_from([[], "x", 1, None, [payload]]))
    if mutation == "not_json":
        return draw(st.sampled_from(NOT_JSON))
    if mutation == "nested":
        return nesting(draw(depths()), "objects")
    if mutation == "top_level":
        key = draw(st.sampled_from(["stream", "echo_text", "extra"]))
        return payload | {key: draw(without_huge(json_edge_values()))}
    if params is None:
        return payload
    if mutation == "field":
        name = draw(st.sampled_from(sorted(PARAMS_BASE)))
        params[name] = draw(forged_field_values(name))
    elif mutation == "unknown_field":
        unknown = draw(st.sampled_from(["beam", "n", "", "max_new_tokens"]))
        params[unknown] = draw(without_huge(json_edge_values()))
    elif mutation == "missing_field":
        params.pop(draw(st.sampled_from(sorted(set(PARAMS_BASE) - {"max_tokens"}))), None)
    return payload | {"params": params}


ID_EDGES = (0, 1, 2, VOCAB_SIZE - 1, VOCAB_SIZE, VOCAB_SIZE + 1, 100_000, INT32_MAX, -1, -2, INT32_MIN)
ODD_IDS = [[], [VOCAB_SIZE], [-1], [INT32_MAX], [INT32_MIN], [1] * 600, [1] * 5000]


def forged_ids() -> st.SearchStrategy[list[int]]:
    """Prompt ids: in the vocabulary, outside it, negative, none, or more than any context holds."""
    inside = st.integers(0, VOCAB_SIZE - 1)
    mixed = st.lists(st.one_of(inside, st.sampled_from(ID_EDGES)), min_size=0, max_size=16)
    return st.one_of(st.lists(inside, min_size=1, max_size=16), mixed, st.sampled_from(ODD_IDS))


@st.composite
def forged(draw: st.DrawFn, variants: tuple[str, ...]) -> FuzzRequest:
    """input_ids + request_config sent to llm_<variant> directly, as only preprocessing should."""
    _, model = draw(family_and_model(variants, ("llm",)))
    if draw(st.booleans()):  # prompt ids in the vocabulary, params of wrong types: the parameters' own checks
        ids = draw(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=16))
        config = draw(typed_config())
    else:
        ids = draw(forged_ids())
        valid = json.dumps(forged_payload({"max_tokens": 4})).encode()
        config = draw(forged_config()) if draw(st.integers(0, 9)) else valid
    inputs = {"input_ids": TensorSpec("input_ids", "INT32", (len(ids),), tuple(ids)),
              "request_config": TensorSpec("request_config", "BYTES", (1,), (config,))}
    extra = draw(st.sampled_from([None, None, None, "text_input", "max_tokens", "drop_config", "drop_ids"]))
    if extra == "text_input":
        inputs["text_input"] = tensor("text_input", "Hello", "llm")
    elif extra == "max_tokens":
        inputs["max_tokens"] = tensor("max_tokens", 4, "llm")
    elif extra in ("drop_config", "drop_ids"):
        del inputs["request_config" if extra == "drop_config" else "input_ids"]
    return request_of("forged", model, inputs)
