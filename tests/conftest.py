"""Shared fixtures: the real SmolLM2 directory (built by `specserve prepare`, idempotent).

Without CUDA the Triton kernels can only run under the interpreter. TRITON_INTERPRET is read when
`@triton.jit` decorates a kernel, i.e. when `specserve_kernels` is first imported by any test
module, so it is set here, before collection.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from specserve.prepare import prepare

    return prepare()  # a no-op once `make prepare` has run
