"""Readers of one request input's value: a [1] tensor's element as a bool, int or float, BYTES
as UTF-8 text, a list of strings, JSON text. Each error is a `RequestError` whose message starts
with the field's name; sizes are checked before anything is decoded. What the values mean (the
contract, its defaults and bounds) is `parsing`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from specserve.serving.contract import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_UTF8_BYTES_PER_CHAR, RequestError


def tensor_value(inputs: Mapping[str, np.ndarray], name: str) -> Any | None:
    """The single element of an optional [1] tensor, or None when absent."""
    if name not in inputs:
        return None
    arr = np.asarray(inputs[name])
    if arr.size != 1:
        raise RequestError(f"{name}: expected exactly one value, got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def tensor_bool(inputs: Mapping[str, np.ndarray], name: str) -> bool | None:
    v = tensor_value(inputs, name)
    if v is None:
        return None
    if not isinstance(v, (bool, np.bool_)):
        raise RequestError(f"{name}: expected BOOL, got {np.asarray(inputs[name]).dtype}")
    return bool(v)


def tensor_int(inputs: Mapping[str, np.ndarray], name: str) -> int | None:
    v = tensor_value(inputs, name)
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise RequestError(f"{name}: expected an integer tensor, got {np.asarray(inputs[name]).dtype}")
    return int(v)


def tensor_float(inputs: Mapping[str, np.ndarray], name: str) -> float | None:
    v = tensor_value(inputs, name)
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise RequestError(f"{name}: expected a float tensor, got {np.asarray(inputs[name]).dtype}")
    return float(str(v)) if isinstance(v, np.float32) else float(v)  # FP32 0.9 -> 0.9, not 0.8999999761


def check_bytes(value: Any, name: str, max_bytes: int, why: str = "") -> None:
    """Refuse a BYTES element longer than `max_bytes`, before anything decodes it."""
    if isinstance(value, (bytes, np.bytes_, str)) and len(value) > max_bytes:
        raise RequestError(f"{name}: {len(value)} bytes, more than the {max_bytes} allowed{why}")


def utf8_text(value: Any, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"{name}: not valid UTF-8 ({e.reason})") from None
    if isinstance(value, str):
        return value
    raise RequestError(f"{name}: expected BYTES (a string), got {type(value).__name__}")


def tensor_strings(inputs: Mapping[str, np.ndarray], name: str) -> list[str]:
    """A BYTES [-1] tensor as a list of non-empty strings (empty entries are padding).

    At most MAX_STOP_STRINGS entries (padding included), each of at most MAX_STOP_CHARS *
    MAX_UTF8_BYTES_PER_CHAR bytes: both are checked before any entry is decoded."""
    if name not in inputs:
        return []
    values = np.asarray(inputs[name]).reshape(-1)
    if values.size > MAX_STOP_STRINGS:
        raise RequestError(f"{name}: at most {MAX_STOP_STRINGS} entries, got {values.size}")
    for v in values:
        check_bytes(v, name, MAX_STOP_CHARS * MAX_UTF8_BYTES_PER_CHAR)
    return [s for s in (utf8_text(v, name) for v in values) if s]


def stop_strings(strings: list[str], name: str) -> tuple[str, ...]:
    """Stop strings within the bounds: at most MAX_STOP_STRINGS, each at most MAX_STOP_CHARS characters."""
    if len(strings) > MAX_STOP_STRINGS:
        raise RequestError(f"{name}: at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
    for s in strings:
        if len(s) > MAX_STOP_CHARS:
            raise RequestError(f"{name}: a stop string is at most {MAX_STOP_CHARS} characters, got {len(s)}")
    return tuple(strings)


def json_text(raw: Any, name: str, max_bytes: int) -> str:
    """A JSON input's text: its size checked before it is decoded."""
    check_bytes(raw, name, max_bytes)
    return utf8_text(raw, name)


def json_loads(text: str, name: str) -> Any:
    """json.loads, every failure a RequestError naming `name` (nesting deeper than the interpreter's
    recursion limit included)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"{name}: not valid JSON ({e.msg} at position {e.pos})") from None
    except RecursionError:
        raise RequestError(f"{name}: nested too deeply") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise RequestError(f"{name}: not valid JSON ({e})") from None
