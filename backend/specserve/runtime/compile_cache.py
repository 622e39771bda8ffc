"""Where compiled CPU programs are kept: each program's key, its package on disk and its loading.

A package is cached under a key of everything its program depends on (`program_key`: the weights,
the sizes asked for, the code the program is traced from, torch's version and the CPU's flags),
compiled by one process while the others wait on a file lock, loaded once per process and shared,
and called without the GIL (`runtime.unlocked`). A package that does not load is set aside and
compiled again once; packages unused for weeks are removed.

This module does not say what a program computes (`runtime.compiled` exports the forwards) or when
one is used (the runtime's runners decide).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch
from filelock import FileLock

from specserve.hardware import cpu_flags
from specserve.runtime.unlocked import unlocked
from specserve_kernels import gguf_gemm

log = logging.getLogger(__name__)

PREFILL_CONFIGS = {"freezing": True}  # inductor settings: frozen weights, oneDNN's prepacked matmuls
# the modules whose code a program is traced from (under the specserve package): an edit to any of
# them is another program, never a stale one loaded from the compile cache
TRACED_SOURCES = ("runtime/compiled.py", "runtime/draft_model.py", "models/llama.py", "models/cpu_linear.py",
                  "models/eagle_head.py", "models/mtp_head.py", "models/gguf.py")
STALE_AFTER_DAYS = 14  # a compile-cache package unused this long is deleted when another is compiled
CORRUPT_SUFFIX = ".corrupt"  # a package that did not load, moved out of its key (`set_aside`)
Runner = Callable[..., list[torch.Tensor]]
_loaded: weakref.WeakValueDictionary[tuple[str, int], Runner] = weakref.WeakValueDictionary()  # (path, inode)
T = TypeVar("T")


def can_compile(device: torch.device) -> bool:
    """AOTInductor's C++ backend needs a CPU and a C++ compiler (g++, which set-up installs)."""
    return device.type == "cpu" and shutil.which("g++") is not None


@functools.cache
def traced_sources() -> bytes:
    """The source of every module whose code the programs are traced from (`TRACED_SOURCES`, the GGUF kernel)."""
    package = Path(__file__).resolve().parents[1]
    kernel = [gguf_gemm.SOURCE, Path(gguf_gemm.__file__)]  # what a GGUF layer's op runs
    return b"".join(path.read_bytes() for path in [*(package / name for name in TRACED_SOURCES), *kernel])


def program_key(tensors: Iterable[tuple[str, torch.Tensor]], *parts: object) -> str:
    """A digest of everything a compiled program depends on: its weights as loaded (dtype
    included), `parts` (the cache's shape, whose strides are baked in; the sizes and outputs asked
    for), the code it is traced from (`traced_sources`), torch's version and the CPU's flags (the
    code is vectorised for them)."""
    h = hashlib.sha256()
    for name, t in sorted(tensors, key=lambda item: item[0]):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy())
    h.update(repr((parts, torch.__version__, sorted(cpu_flags()), traced_sources())).encode())
    return h.hexdigest()[:24]


def load_or_compile(path: Path, export: Callable[[], torch.export.ExportedProgram],
                    inductor_configs: dict | None = None) -> tuple[Runner, bool]:
    """The package at `path`, compiled from `export()` first if it is not there; (runner, compiled now).

    Neither step leaves a copy of the program behind: inductor compiles in a scratch cache that
    is removed afterwards (the package holds everything a load needs), and the package is
    unpacked into a scratch directory removed once its library is loaded, and called without the
    GIL (`runtime.unlocked`). A program holds its
    weights, so each copy would cost as much disk as the model. For the same reason a process
    loads a package once: engines that want the same program (the same weights, cache shape and
    outputs: `none`, NGRAM and EAGLE-2 beside each other in one bench) share the loaded one while
    any of them holds it (the programs keep no state between calls).

    A package that does not load is set aside (`set_aside`); a stored one is then compiled again
    and loaded, once: a second failure raises, and the next build compiles it afresh."""
    start = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        compiled_now = not path.is_file()
        loaded = None if compiled_now else _loaded.get((str(path), path.stat().st_ino))
        if loaded is not None:
            os.utime(path)
            return loaded, False
        if compiled_now:
            compile_package(path, export, inductor_configs)
        try:
            runner = _load_or_set_aside(path)
        except Exception:  # a stored package that does not load: compiled again, once
            if compiled_now:
                raise
            compile_package(path, export, inductor_configs)
            compiled_now = True
            runner = _load_or_set_aside(path)
        _loaded[(str(path), path.stat().st_ino)] = runner
    log.info("%s %s in %.1f s", "compiled" if compiled_now else "loaded", path, time.perf_counter() - start)
    return runner, compiled_now


def compile_package(path: Path, export: Callable[[], torch.export.ExportedProgram],
                    inductor_configs: dict | None = None) -> None:
    """`export()` compiled by AOTInductor into the package at `path` (the caller holds its lock)."""
    log.info("compiling %s for this CPU (once; kept in %s)", path.name, path.parent)
    tmp = path.with_suffix(".tmp.pt2")
    with _scratch_env("TORCHINDUCTOR_CACHE_DIR", "specserve-inductor-"):
        with torch.inference_mode(False), torch.no_grad():
            program = export()
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp),
                                                 inductor_configs=inductor_configs or PREFILL_CONFIGS)
    tmp.replace(path)  # whole packages only: a crash mid-compile leaves nothing under the key
    remove_stale(path.parent)


def _load_or_set_aside(path: Path) -> Runner:
    """The package at `path` loaded (its modification time is its last use); where it does not
    load, it is set aside and the loader's error raised."""
    os.utime(path)
    with _scratch_env("TMPDIR", "specserve-aoti-"):  # where the loader unpacks the package
        try:
            model = torch._inductor.aoti_load_package(str(path))
        except Exception as e:  # a package cut short or overwritten: not a zip, missing files
            set_aside(path, e)
            raise
        return unlocked(model, path.parent / "kernels")


def set_aside(path: Path, error: Exception) -> Path:
    """Moves a package that does not load out of its key (to `<name>.corrupt`, replacing an older
    one; `remove_stale` deletes it in time), so that no build loads it again; the new path."""
    corrupt = path.with_name(path.name + CORRUPT_SUFFIX)
    path.replace(corrupt)
    log.warning("%s does not load (%s: %s); set aside as %s, to be compiled again", path,
                type(error).__name__, error, corrupt.name)
    return corrupt


@contextmanager
def _scratch_env(variable: str, prefix: str) -> Iterator[None]:
    """Points the environment variable at a new temporary directory, removed (with what was
    written there) and the variable restored on exit. The C++ loader reads TMPDIR when it runs;
    the library it loads stays mapped after its file is gone."""
    old = os.environ.get(variable)
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        os.environ[variable] = scratch
        try:
            yield
        finally:
            if old is None:
                del os.environ[variable]
            else:
                os.environ[variable] = old


def remove_stale(cache_dir: Path, max_age_days: float = STALE_AFTER_DAYS) -> None:
    """Deletes packages not used for max_age_days, and those set aside as corrupt that long ago: a
    new torch, model or version of this module makes new keys, and the old packages (each the size
    of the model or more) would stay forever."""
    cutoff = time.time() - max_age_days * 86400
    for old in cache_dir.glob("*.pt2"):
        if old.stat().st_mtime < cutoff:
            log.info("removing %s: unused for %d days", old.name, max_age_days)
            old.unlink(missing_ok=True)
            Path(str(old) + ".lock").unlink(missing_ok=True)
    for corrupt in cache_dir.glob(f"*.pt2{CORRUPT_SUFFIX}"):  # set aside: kept a while to look into
        if corrupt.stat().st_mtime < cutoff:
            corrupt.unlink(missing_ok=True)


def compiled_or_none(what: str, build: Callable[[], T]) -> T | None:
    """build(), or None with a warning when compiling fails: the compiled programs are an
    optimisation, so a model is served eagerly rather than not at all."""
    try:
        return build()
    except Exception as e:  # export, inductor or the C++ compiler: anything makes it eager
        log.warning("%s: no compiled forward, running eagerly (%s: %s)", what, type(e).__name__, e)
        return None
