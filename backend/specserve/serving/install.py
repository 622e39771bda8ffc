"""Where tritonserver is: on PATH (an NGC container), or else the copy inside the
`nvidia-pytriton` wheel, whose Python-backend stub for this interpreter is put beside its
backends once under a cache directory. The stub's embedded interpreter finds this virtualenv's
packages because the venv's `bin/` is first on its PATH. This module starts nothing.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path | None  # None = the server's built-in default
    env: dict[str, str]  # added to the server's environment


def _pytriton_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("tritonserver: not on PATH and the nvidia-pytriton wheel is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _wheel_backend_dir(server_dir: Path, cache_root: Path) -> Path:
    """`<cache>/backends` = the wheel's backends/ plus the stub for this Python (made once, atomically)."""
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server_dir / "python_backend_stubs" / py / "triton_python_backend_stub"
    if not stub.is_file():
        raise FileNotFoundError(f"tritonserver: the wheel has no Python-backend stub for Python {py}")
    target = cache_root / f"backends-py{py}-{int(stub.stat().st_mtime)}"
    if (target / "python" / "triton_python_backend_stub").is_file():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="backends-", dir=cache_root))
    shutil.copytree(server_dir / "backends", tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub, tmp / "python" / "triton_python_backend_stub")
    try:
        tmp.rename(target)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def find_tritonserver(cache_root: Path | None = None) -> TritonInstall:
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path), None, {})
    server_dir = _pytriton_dir() / "tritonserver"
    cache_root = cache_root or (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specserve" / "tritonserver"
    )
    libs = [str(server_dir.parent.parent / "nvidia_pytriton.libs")]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        # the stub links libpython3.X.so dynamically: give it this interpreter's (e.g. pyenv's),
        # not the system one, or compiled stdlib modules such as _ssl fail on missing symbols
        libs.insert(0, str(sysconfig.get_config_var("LIBDIR")))
    venv_bin = str(Path(sys.executable).parent)
    ld = os.pathsep.join(p for p in (*libs, os.environ.get("LD_LIBRARY_PATH", "")) if p)
    return TritonInstall(
        binary=server_dir / "bin" / "tritonserver",
        backend_dir=_wheel_backend_dir(server_dir, cache_root),
        env={"LD_LIBRARY_PATH": ld, "PATH": os.pathsep.join([venv_bin, os.environ.get("PATH", "")])},
    )
