"""The Hypothesis strategies' building blocks: well-formed tensors and requests for a category to
break, valid values of each input, values of any datatype, prompts, the forged `request_config`
payload and the choice of model.

It holds no category (those are in `malformed`, `edge_values` and `categories`) and draws nothing
itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

try:
    from hypothesis import strategies as st
except ImportError as e:  # a client-only install without the test extra
    raise ImportError("the request fuzz needs hypothesis: pip install hypothesis "
                      "(or the project's [test] extra)") from e

from specserve_client.fuzz.contract import (
    INPUTS,
    INVALID_UTF8,
    MAX_TOKENS,
    PARAMS_BASE,
    VARIABLE_LENGTH,
    VOCAB_SIZE,
    FuzzRequest,
    TensorSpec,
)

# ---- strategies: the building blocks -----------------------------------------------------------

FAMILIES = ("llm", "ensemble")
PROMPTS = ("Hi", "Hello", "Count from 1 to 5.", "What is speculative decoding?", "Say yes.",
           "Tell me a joke.")


def shape_for(name: str, family: str, count: int = 1) -> tuple[int, ...]:
    """The shape the model declares for `name` holding `count` values: [n], or [1, n] (ensemble)."""
    inner = (count,) if name in VARIABLE_LENGTH else (1,)
    return (1, *inner) if family == "ensemble" else inner


def tensor(name: str, value: Any, family: str) -> TensorSpec:
    """A well-formed tensor of the contract's datatype for a plain value (a list: variable inputs)."""
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    values = tuple(v.encode("utf-8") if isinstance(v, str) else v for v in values)
    return TensorSpec(name, INPUTS[name], shape_for(name, family, len(values)), values)


def element(datatype: str) -> st.SearchStrategy[Any]:
    """Any value a tensor of `datatype` holds (edges included: Hypothesis favours them)."""
    if datatype == "BOOL":
        return st.booleans()
    if datatype.startswith("INT"):
        bits = int(datatype[3:])
        return st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    if datatype.startswith("UINT"):
        return st.integers(0, 2 ** int(datatype[4:]) - 1)
    if datatype.startswith("FP"):
        return st.floats(width=int(datatype[2:]))
    return byte_strings()


def byte_strings() -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=24), st.text(max_size=24).map(lambda s: s.encode("utf-8")),
                     st.sampled_from(INVALID_UTF8),
                     st.sampled_from([b"", b"{}", b"[]", b"null", b"8", b"true"]))


def prompts() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(PROMPTS), st.text(min_size=1, max_size=40))


def max_tokens() -> st.SearchStrategy[int]:
    return st.integers(1, MAX_TOKENS)


@st.composite
def base_inputs(draw: st.DrawFn, family: str) -> dict[str, TensorSpec]:
    """A well-formed request (at most MAX_TOKENS tokens) that a category then breaks in one place."""
    values: dict[str, Any] = {"text_input": draw(prompts()), "max_tokens": draw(max_tokens())}
    optional = {"stream": st.booleans(), "apply_chat_template": st.booleans(),
                "temperature": st.sampled_from([0.0, 0.7]), "seed": st.integers(0, 2**64 - 1),
                "ignore_eos": st.booleans(), "top_k": st.integers(0, 50)}
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True)):
        values[name] = draw(optional[name])
    return {name: tensor(name, value, family) for name, value in values.items()}


def valid_value(name: str) -> st.SearchStrategy[Any]:
    """A value `name` accepts (a plain value; a list for the variable-length inputs)."""
    special = {
        "text_input": prompts(), "sampling_parameters": st.just('{"temperature": 0}'),
        "max_tokens": max_tokens(), "min_tokens": st.just(0), "min_length": st.just(0),
        "temperature": st.just(0.0), "top_p": st.just(1.0), "top_k": st.just(0),
        "stop_words": st.just(["\n\n"]), "bad_words": st.just([""]), "beam_width": st.just(1),
        "frequency_penalty": st.just(0.0), "presence_penalty": st.just(0.0),
        "repetition_penalty": st.just(1.0),
        "input_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=8),
        "request_config": st.just(json.dumps(forged_payload({}))),
    }
    return special[name] if name in special else element(INPUTS[name])


def forged_payload(params: dict[str, Any]) -> dict[str, Any]:
    """request_config's JSON: PARAMS_BASE (its None-valued fields left out) updated by `params`."""
    merged = {k: v for k, v in PARAMS_BASE.items() if v is not None} | params
    return {"params": merged, "stream": True, "echo_text": None}


@st.composite
def family_and_model(draw: st.DrawFn, variants: tuple[str, ...],
                     families: tuple[str, ...] = FAMILIES) -> tuple[str, str]:
    family = draw(st.sampled_from(families))
    return family, f"{family}_{draw(st.sampled_from(variants))}"


@st.composite
def broken_base(draw: st.DrawFn, variants: tuple[str, ...]) -> tuple[str, str, dict[str, TensorSpec]]:
    """(family, model, a well-formed request's tensors) for a category to break."""
    family, model = draw(family_and_model(variants))
    return family, model, draw(base_inputs(family))


def request_of(kind: str, model: str, inputs: dict[str, TensorSpec] | Iterable[TensorSpec],
               outputs: tuple[str, ...] | None = None) -> FuzzRequest:
    tensors = tuple(inputs.values()) if isinstance(inputs, dict) else tuple(inputs)
    return FuzzRequest(kind, model, tensors, outputs or FuzzRequest.outputs)
