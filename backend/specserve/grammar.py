"""What a structured-output request asks for (`GrammarSpec`) and the request forms that carry it.

Clients send a constraint the way they send it to Triton's vLLM and TensorRT-LLM backends:

- vLLM's `structured_outputs` object in `sampling_parameters` (also under its older key
  `guided_decoding`; an object or the object as a JSON string, as Triton's OpenAI frontend sends
  it): exactly one of `json` (a JSON schema), `json_object`, `regex`, `choice`, `grammar` (EBNF);
- TensorRT-LLM's tensors `guided_decoding_guide_type` (`json`, `json_schema`, `regex`,
  `ebnf_grammar`) and `guided_decoding_guide`.

Both become one frozen `GrammarSpec`. JSON is generated without free whitespace (a compact
`{"a": 1}`) unless the request sets `disable_any_whitespace: false`. This module checks the form
only; compiling the grammar (and refusing one that does not compile) is `engine.grammar`'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specserve.knobs import shown

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf")
MAX_CHOICES = 256

# vLLM's StructuredOutputsParams: the constraint keys (exactly one is set) and the options
VLLM_CONSTRAINTS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                    "grammar": "ebnf"}
VLLM_OPTIONS_AT_DEFAULT = {"disable_fallback": (False, True), "disable_additional_properties": (False,),
                           "whitespace_pattern": (None,), "structural_tag": (None,),
                           "backend": (None, "auto", "xgrammar"), "_backend": (None, "auto", "xgrammar")}
TRTLLM_NO_GUIDE = frozenset({"", "none"})  # guided_decoding_guide_type values that ask for no constraint
TRTLLM_GUIDE_TYPES = {"json": "json_object", "json_schema": "json_schema", "regex": "regex",
                      "ebnf_grammar": "ebnf"}


@dataclass(frozen=True)
class GrammarSpec:
    """One request's constraint: `kind` (one of GRAMMAR_KINDS) and its `value` (the schema as JSON
    text, the regex, the EBNF grammar, the choices as a JSON array; empty for json_object);
    `any_whitespace` lets JSON carry free whitespace between tokens."""

    kind: str
    value: str = ""
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"kind: must be one of {', '.join(GRAMMAR_KINDS)}, got {shown(self.kind)}")
        if not isinstance(self.any_whitespace, bool):
            raise ValueError(f"any_whitespace: must be true or false, got {shown(self.any_whitespace)}")
        if problem := value_problem(self.kind, self.value):
            raise ValueError(f"value: {problem}")

    @property
    def choices(self) -> list[str]:
        return json.loads(self.value) if self.kind == "choice" else []

    @classmethod
    def from_dict(cls, obj: Any, name: str) -> GrammarSpec:
        """The spec as `dataclasses.asdict` wrote it (between the ensemble's models)."""
        if not isinstance(obj, dict) or set(obj) - {"kind", "value", "any_whitespace"} or "kind" not in obj:
            raise ValueError(f"{name}: expected an object of kind, value and any_whitespace, got {shown(obj)}")
        try:
            return cls(**obj)
        except ValueError as e:
            raise ValueError(f"{name}.{e}") from None


def value_problem(kind: str, value: Any) -> str | None:
    """What is wrong with a constraint's value for its kind (None: nothing a parser can see)."""
    if not isinstance(value, str):
        return f"must be a string, got {shown(value)}"
    if kind == "json_object":
        return None if not value else "must be empty for json_object"
    if not value:
        return f"the {kind} is empty"
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as e:
            return f"the schema is not valid JSON ({e.msg})"
        return None if isinstance(schema, (dict, bool)) else f"a JSON schema is an object, got {shown(schema)}"
    if kind == "choice":
        try:
            choices = json.loads(value)
        except json.JSONDecodeError:
            choices = None
        if not (isinstance(choices, list) and 0 < len(choices) <= MAX_CHOICES
                and all(isinstance(c, str) and c for c in choices)):
            return f"must be 1 to {MAX_CHOICES} non-empty strings"
    return None


def from_vllm(raw: Any, name: str) -> GrammarSpec:
    """vLLM's `structured_outputs` / `guided_decoding` value (an object, or one as a JSON string)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not valid JSON ({e.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{name}: expected an object, got {shown(raw)}")
    for key, value in raw.items():
        if key in VLLM_CONSTRAINTS or key == "disable_any_whitespace":
            continue
        if key not in VLLM_OPTIONS_AT_DEFAULT:
            raise ValueError(f"{name}.{key}: unknown parameter")
        if value not in VLLM_OPTIONS_AT_DEFAULT[key]:
            raise ValueError(f"{name}.{key}: only {', '.join(json.dumps(v) for v in VLLM_OPTIONS_AT_DEFAULT[key])} "
                             f"supported, got {shown(value)}")
    given = [k for k in VLLM_CONSTRAINTS if raw.get(k) not in (None, False)]
    if len(given) != 1:
        raise ValueError(f"{name}: set exactly one of {', '.join(VLLM_CONSTRAINTS)}, got {len(given)}")
    key = given[0]
    value = raw[key]
    no_whitespace = raw.get("disable_any_whitespace", True)
    if not isinstance(no_whitespace, bool):
        raise ValueError(f"{name}.disable_any_whitespace: expected a boolean, got {shown(no_whitespace)}")
    kind = VLLM_CONSTRAINTS[key]
    if key == "json":
        if isinstance(value, dict):
            value = json.dumps(value)
        elif not isinstance(value, str):
            raise ValueError(f"{name}.json: expected a JSON schema (an object or its text), got {shown(value)}")
    elif key == "json_object":
        if value is not True:
            raise ValueError(f"{name}.json_object: expected true, got {shown(value)}")
        value = ""
    elif key == "choice":
        if not isinstance(value, list):
            raise ValueError(f"{name}.choice: expected a list of strings, got {shown(value)}")
        value = json.dumps(value)
    elif not isinstance(value, str):
        raise ValueError(f"{name}.{key}: expected a string, got {shown(value)}")
    return _spec(kind, value, not no_whitespace, f"{name}.{key}")


def from_trtllm(guide_type: str, guide: str | None) -> GrammarSpec | None:
    """TensorRT-LLM's `guided_decoding_guide_type` and `guided_decoding_guide` tensors."""
    if guide_type in TRTLLM_NO_GUIDE:
        if guide:
            raise ValueError("guided_decoding_guide: needs guided_decoding_guide_type")
        return None
    if guide_type not in TRTLLM_GUIDE_TYPES:
        raise ValueError(f"guided_decoding_guide_type: must be one of none, {', '.join(TRTLLM_GUIDE_TYPES)}, "
                         f"got {shown(guide_type)}")
    kind = TRTLLM_GUIDE_TYPES[guide_type]
    if kind != "json_object" and not guide:
        raise ValueError(f"guided_decoding_guide: missing for guided_decoding_guide_type {guide_type}")
    return _spec(kind, "" if kind == "json_object" else guide or "", False, "guided_decoding_guide")


def _spec(kind: str, value: str, any_whitespace: bool, name: str) -> GrammarSpec:
    if problem := value_problem(kind, value):
        raise ValueError(f"{name}: {problem}")
    return GrammarSpec(kind, value, any_whitespace)
