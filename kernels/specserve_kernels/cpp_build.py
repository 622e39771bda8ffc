"""C++ sources built into this process with torch's extension builder (g++, ninja): once per
source and torch version under a build root, later calls and processes loading what was built.

Shared by the CPU kernels' ops (`OpLibrary`: `few_row_gemm`, `gguf_gemm`, `slot_attention`) and the
runtime's GIL-free program call (`specserve.runtime.unlocked`). This module does not decide whether a
build is wanted: `build` raises where it cannot build, `OpLibrary.load` says False and the caller falls back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def has_ninja() -> bool:
    """torch's builder runs `ninja` from PATH; the PyPI package's binary (a dependency) sits beside
    the interpreter, which is not on PATH when the venv is not activated (a Triton stub, `make test`)."""
    from torch.utils.cpp_extension import is_ninja_available

    try:
        import ninja

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    except ImportError:
        pass  # a ninja on PATH serves as well
    return is_ninja_available()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (avx2, fma, f16c, avx512f, ...)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "flags:")
    return frozenset(line.split(":", 1)[1].split())


def can_build_for(required_flags: frozenset[str]) -> bool:
    """Whether this machine can build and run an x86-64 kernel that needs these CPU flags: the flags, g++, ninja."""
    return (platform.machine() in ("x86_64", "AMD64") and required_flags <= cpu_flags()
            and shutil.which("g++") is not None and has_ninja())


def source_digest(source: Path) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()[:16]


def build(name: str, source: Path, build_root: Path, **options: Any) -> Any:
    """torch's `cpp_extension.load` of `source` as extension `name` (options: its keyword
    arguments) in `build_root/<stem>-<digest>-torch<version>`; what it returns (the module, or None
    for `is_python_module=False`). Raises where it cannot build."""
    from filelock import FileLock
    from torch.utils.cpp_extension import load as build_extension

    if not has_ninja():
        raise RuntimeError("no ninja to build with")
    build_dir = build_root / f"{source.stem}-{source_digest(source)}-torch{torch.__version__}"
    build_dir.mkdir(parents=True, exist_ok=True)
    # torch's own build lock (`lock`, a file that exists) outlives a process killed mid-build, and
    # every later build then waits on it forever; ours is released with its holder, so whoever
    # holds it may remove a `lock` left behind
    with FileLock(str(build_dir / "specserve.lock")):
        (build_dir / "lock").unlink(missing_ok=True)
        return build_extension(name=name, sources=[str(source)], build_directory=str(build_dir), verbose=False,
                               **options)


DEFAULT_BUILD_ROOT = Path.home() / ".cache/specserve/kernels"


class OpLibrary:
    """A C++ source of torch custom ops, built and registered at most once per process: `load` builds it (or
    loads what an earlier build left under the build root), then runs `register_fake` (the ops' shape
    functions). Where the machine lacks `required_flags`, g++ or ninja, or the build fails, `load` is False
    with a warning naming `fallback`, what the caller keeps instead."""

    def __init__(self, name: str, source: Path, required_flags: frozenset[str], cflags: list[str], fallback: str,
                 register_fake: Any) -> None:
        self.name, self.source, self.required_flags = name, source, required_flags
        self.cflags, self.fallback, self.register_fake = cflags, fallback, register_fake
        self._loaded: bool | None = None  # once per process, whichever build root it came from

    def supported(self) -> bool:
        return can_build_for(self.required_flags)

    def source_digest(self) -> str:
        return source_digest(self.source)

    def load(self, build_root: Path | None = None) -> bool:
        if self._loaded is None:
            self._loaded = self.supported() and self._build(build_root or DEFAULT_BUILD_ROOT)
        return self._loaded

    def loaded(self) -> bool:
        """Whether an earlier `load` registered the ops in this process (this never builds anything)."""
        return bool(self._loaded)

    def _build(self, build_root: Path) -> bool:
        try:
            build(self.name, self.source, build_root, extra_cflags=["-O3", *self.cflags, "-fopenmp"],
                  extra_ldflags=["-fopenmp"], is_python_module=False)
        except Exception as e:  # the C++ toolchain: the ops are optimisations, so the caller falls back
            log.warning("%s not built, keeping %s (%s: %s)", self.name, self.fallback, type(e).__name__, e)
            return False
        self.register_fake()
        return True
