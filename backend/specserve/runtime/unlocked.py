"""Compiled programs that let the server's other Python threads run while they compute.

torch's binding of a loaded AOTInductor package runs the whole forward holding Python's GIL, so
while a prompt chunk's forward runs (up to hundreds of ms on a CPU), the thread that sends
responses and the threads that take requests wait: responses of one step left after the next
forward. `unlocked(runner)` calls the same package's C++ `run` from a small extension that
releases the GIL meanwhile (`cpu/unlocked_run.cpp`, built once per source and torch version by
`specserve_kernels.cpp_build`, like the few-row matmul kernel). Where it cannot be built or
does not take torch's loader object, the runner is returned as it is (a warning says so).

This module does not compile or load programs (`runtime.compiled` does) and does nothing on CUDA.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.utils._pytree as pytree

from specserve_kernels import cpp_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu") / "unlocked_run.cpp"
_extension: ModuleType | None | bool = None  # False: tried, not available


class UnlockedRunner:
    """A loaded package (`torch._inductor.aoti_load_package`'s model) called as it is, its
    forward run without the GIL: positional tensors in, its outputs as the package returns them."""

    def __init__(self, model: Any, extension: ModuleType) -> None:
        self.model, self._run = model, extension.run
        self._loader = model.loader
        self._out_spec = pytree.treespec_loads(self._loader.get_call_spec()[1])

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return pytree.tree_unflatten(self._run(self._loader, list(inputs)), self._out_spec)


def unlocked(model: Any, build_root: Path) -> Any:
    """`model` (a loaded package) as an `UnlockedRunner`, or `model` itself where the extension
    is not available."""
    extension = _load(build_root)
    if extension is None:
        return model
    try:
        extension.check(model.loader)
    except Exception as e:  # noqa: BLE001 - another torch build's loader type: keep torch's own call
        log.warning("compiled programs keep the GIL while they run (%s: %s)", type(e).__name__, e)
        return model
    return UnlockedRunner(model, extension)


def _load(build_root: Path) -> ModuleType | None:
    global _extension
    if _extension is None:
        _extension = _build(build_root) or False
    return _extension or None


def _build(build_root: Path) -> ModuleType | None:
    try:
        return cpp_build.build("specserve_unlocked_run", SOURCE, build_root, extra_cflags=["-O2"])
    except Exception as e:  # noqa: BLE001 - the C++ toolchain: the programs still run, holding the GIL
        log.warning("compiled programs keep the GIL while they run: extension not built (%s: %s)",
                    type(e).__name__, e)
        return None
