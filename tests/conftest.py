"""Shared fixtures: the real SmolLM2 directory (built by `specserve prepare`, idempotent)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from specserve.prepare import prepare

    return prepare()  # a no-op once `make prepare` has run
