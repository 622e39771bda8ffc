"""The categories that break a request's form: wrong datatypes, shapes and byte sizes, shared-memory
regions that do not exist, a missing `text_input`, empty tensors, invalid UTF-8 and deeply nested
JSON (`nesting`, `depths`: also the forged `request_config`'s nesting).

It holds no category of edge values (`edge_values`) nor the table of all categories (`categories`).
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from specserve_client.fuzz.blocks import broken_base, element, request_of, shape_for, tensor, valid_value
from specserve_client.fuzz.contract import (
    CONTRACT_INPUTS,
    INPUTS,
    INVALID_UTF8,
    NUMPY_TYPES,
    VARIABLE_LENGTH,
    FuzzRequest,
    Long,
    TensorSpec,
)

# ---- strategies: one per category, each taking the variants ------------------------------------


@st.composite
def wrong_datatype(draw: st.DrawFn, variants: tuple[str, ...]) -> FuzzRequest:
    family, model, inputs = draw(broken_base(variants))
    name = draw(st.sampled_from(sorted(INPUTS)))
    datatype = draw(st.sampled_from([d for d in NUMPY_TYPES if d != INPUTS[name]]))
    count = draw(st.integers(1, 3)) if name in VARIABLE_LENGTH else 1
    values = tuple(draw(st.lists(element(datatype), min_size=count, max_size=count)))
    inputs[name] = TensorSpec(name, datatype, shape_for(name, family, count), values)
    return request_of("datatype", model, inputs)


ODD_SHAPES = ((-1,), (2**31,), (1, -1), (2**40,), (-1, 1), (1, 2**62))
SHAPES = ((), (0,), (2,), (3,), (1, 1), (1, 2), (2, 1), (1, 1, 1), (1, 0), (0, 1), (2, 2), (1, 1, 1, 1))


@st.composite
def wrong_shape(draw: st.DrawFn, variants: tuple[str, ...]) -> FuzzRequest:
    family, model, inputs = draw(broken_base(variants))
    name = draw(st.sampled_from(sorted(INPUTS)))
    shape = draw(st.sampled_from(SHAPES + ODD_SHAPES))
    count = 1 if shape in ODD_SHAPES else math.prod(shape)
    value = draw(valid_value(name))
    one = value[0] if isinstance(value, list) and value else value
    inputs[name] = TensorSpec(name, INPUTS[name], shape, tensor(name, [one] * count, family).values)
    return request_of("shape", model, inputs)


@st.composite
def wrong_byte_size(draw: st.DrawFn, variants: tuple[str, ...]) -> FuzzRequest:
    family, model, inputs = draw(broken_base(variants))
    name = draw(st.sampled_from(sorted(CONTRACT_INPUTS if family == "ensemble" else INPUTS)))
    delta = draw(st.one_of(st.integers(-8, -1), st.integers(1, 16)))
    good = tensor(name, draw(valid_value(name)), family)
    inputs[name] = TensorSpec(name, good.datatype, good.shape, good.values, size_delta=delta)
    return request_of("byte_size", model, inputs)


@st.composite
def missing_shm_region(draw: st.DrawFn, variants: tuple[str, ...]) -> FuzzRequest:
    _, model, inputs = draw(broken_base(variants))
    name = draw(st.sampled_from(sorted(inputs)))
    region = draw(st.sampled_from(["specserve_fuzz_missing", "", "x" * 300]))
    t = inputs[name]
    inputs[name] = TensorSpec(name, t.datatype, t.shape, t.values, shm_region=region)
    return request_of("shm", model, inputs)


@st.composite
def missing_text(draw: st.DrawFn, variants: tuple[str, ...]) -> FuzzRequest:
    family, model, inputs = draw(broken_base(variants))
    del inputs["text_input"]
    if draw(st.booleans()):
        inputs["sampling_parameters"] = tensor("sampling_parameters", '{"max_tokens": 4}', family)
    if draw(st.booleans()):
        inputs = {}
    return request_of("missing_text", model, inputs)


EMPTY_VALUES = {"text_input": ["", " ", "\n", "\t \n"], "sampling_parameters": ["", " ", "{}", "[]", "null"],
                "stop_words": [[], [""], ["", ""]], "bad_words": [[], [""]]}


@st.composite
def empty_tensor(draw: st.DrawFn, variants: tuple[str, ...]) -> FuzzRequest:
    family, model, inputs = draw(broken_base(variants))
    name = draw(st.sampled_from(sorted(INPUTS)))
    if name in EMPTY_VALUES and draw(st.booleans()):
        inputs[name] = tensor(name, draw(st.sampled_from(EMPTY_VALUES[name])), family)
    else:  # no element at all
        inputs[name] = TensorSpec(name, INPUTS[name], (1, 0) if family == "ensemble" else (0,), ())
    return request_of("empty", model, inputs)


def invalid_utf8() -> st.SearchStrategy[bytes]:
    bad = st.sampled_from(INVALID_UTF8)
    inside = st.tuples(st.text(max_size=8), bad, st.text(max_size=8))
    return st.one_of(bad, inside.map(lambda t: t[0].encode() + t[1] + t[2].encode()))


@st.composite
def bad_utf8(draw: st.DrawFn, variants: tuple[str, ...]) -> FuzzRequest:
    family, model, inputs = draw(broken_base(variants))
    name = draw(st.sampled_from(["text_input", "sampling_parameters", "stop_words", "bad_words"]))
    bad = draw(invalid_utf8())
    if name == "sampling_parameters":
        bad = draw(st.sampled_from([bad, b'{"stop": "' + bad + b'"}', b'{"' + bad + b'": 1}']))
    inputs[name] = tensor(name, [bad] if name in VARIABLE_LENGTH else bad, family)
    return request_of("utf8", model, inputs)


def nesting(depth: int, pattern: str) -> Long:
    """JSON nested `depth` deep: balanced, unbalanced, or inside a sampling key."""
    parts = {
        "lists": ((b"[", depth), (b"]", depth)),
        "objects": ((b'{"a":', depth), (b"1", 1), (b"}", depth)),
        "open": ((b"[", depth),),
        "in_key": ((b'{"temperature": ', 1), (b"[", depth), (b"]", depth), (b"}", 1)),
        "in_stop": ((b'{"stop": ', 1), (b"[", depth), (b'"x"', 1), (b"]", depth), (b"}", 1)),
        "in_unknown": ((b'{"max_tokens": 4, "x": ', 1), (b'{"a":', depth), (b"1", 1), (b"}", depth),
                       (b"}", 1)),
    }
    return Long(parts[pattern])


NESTING_PATTERNS = ("lists", "objects", "open", "in_key", "in_stop", "in_unknown")


def depths() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([10, 100, 999, 1000, 1001, 10_000, 100_000]), st.integers(1, 20_000))


@st.composite
def nested_json(draw: st.DrawFn, variants: tuple[str, ...]) -> FuzzRequest:
    family, model, inputs = draw(broken_base(variants))
    value = nesting(draw(depths()), draw(st.sampled_from(NESTING_PATTERNS)))
    inputs["sampling_parameters"] = TensorSpec("sampling_parameters", "BYTES",
                                               shape_for("sampling_parameters", family), (value,))
    return request_of("nested_json", model, inputs)
