"""What the request-contract tests build their inputs from: numpy tensors as Triton hands them over."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specserve.serving.contract import RequestError, RequestLimits
from specserve.serving.parsing import parse_request

LIMITS = RequestLimits(max_seq_len=256, default_max_tokens=32)
REPO = Path(__file__).resolve().parents[2] / "model_repository"


def b(s: str) -> np.ndarray:
    return np.array([s.encode()], dtype=np.object_)


def req(text: str = "Hello", **inputs: np.ndarray) -> dict[str, np.ndarray]:
    return {"text_input": b(text), **inputs}


def i32(v: int) -> np.ndarray:
    return np.array([v], dtype=np.int32)


def f32(v: float) -> np.ndarray:
    return np.array([v], dtype=np.float32)


def flag(v: bool) -> np.ndarray:
    return np.array([v], dtype=np.bool_)


def sp(obj: object) -> np.ndarray:
    return b(json.dumps(obj))


def words(*values: bytes) -> np.ndarray:
    """A BYTES list tensor (stop_words, bad_words)."""
    return np.array(list(values), dtype=np.object_)


def error_field(inputs: dict[str, np.ndarray], limits: RequestLimits = LIMITS) -> str:
    with pytest.raises(RequestError) as e:
        parse_request(inputs, limits)
    return str(e.value).split(":")[0]


class FakeTokenizer:
    def encode(self, text: str, apply_chat_template: bool) -> list[int]:
        ids = [ord(c) % 100 for c in text]
        return ([1] + ids + [2]) if apply_chat_template else ids
