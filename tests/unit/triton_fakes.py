"""Fakes of `triton_python_backend_utils`'s responses, errors, tensors and metrics, for the Triton
models' unit tests (no Triton): what a test reads back of what the model sent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class FakeError:
    message: str
    code: int

    INTERNAL, INVALID_ARG, UNAVAILABLE, CANCELLED = 13, 3, 14, 1


@dataclass
class FakeResponse:
    output_tensors: list[Any] = field(default_factory=list)
    error: FakeError | None = None

    def outputs(self) -> dict[str, np.ndarray]:
        return {t.name: t.array for t in self.output_tensors}


@dataclass
class FakeTensor:
    name: str
    array: np.ndarray

    def as_numpy(self) -> np.ndarray:
        return self.array


class FakeMetric:
    def __init__(self) -> None:
        self.values: list[float] = []

    def increment(self, v: float) -> None:
        self.values.append(v)

    def observe(self, v: float) -> None:
        self.values.append(v)

    def set(self, v: float) -> None:
        self.values.append(v)


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = 0, 1, 2
    created: dict[str, FakeFamily] = {}

    def __init__(self, name: str, description: str, kind: int) -> None:
        self.name, self.kind, self.metrics = name, kind, []
        FakeFamily.created[name] = self

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> FakeMetric:  # noqa: N802
        assert (buckets is not None) == (self.kind == self.HISTOGRAM)
        m = FakeMetric()
        self.metrics.append((labels, m))
        return m
