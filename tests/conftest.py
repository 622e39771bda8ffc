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

# `make test`'s workers share the cores: each computes on its share, so no OpenMP thread spins
# waiting for one that the other worker's thread displaced
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // WORKERS))

# the order in which `make test`'s workers take whole modules: the long ones first, the kernels' many short
# tests last, where they even out the workers' ends
FIRST = ("tests/model/", "tests/unit/", "tests/kernels/")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules in `FIRST`'s order; `gpu` tests need CUDA: skipped, with the reason shown, on a
    machine without it."""
    items.sort(key=lambda item: next((i for i, top in enumerate(FIRST) if item.nodeid.startswith(top)), len(FIRST)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on a GPU machine: make gpu-check)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from specserve.prepare import prepare

    return prepare()  # a no-op once `make prepare` has run


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir) -> Path:
    """The GGUF file the served model is prepared from (its Q4_1 and Q8_0 blocks)."""
    from specserve.prepare import gguf_path

    return gguf_path()
