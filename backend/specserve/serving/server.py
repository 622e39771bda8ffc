"""Start a real `tritonserver` on the model repository (`specserve serve`, the e2e tests, benchmarks).

Which server: `tritonserver` on PATH (an NGC container) or else the copy inside the
`nvidia-pytriton` wheel. The wheel's copy needs a backend directory holding the Python-backend stub
for the running interpreter next to `libtriton_python.so`; it is assembled once under a cache
directory. The stub's embedded interpreter finds this virtualenv's packages because the venv's
`bin/` is first on its PATH.

`TritonProcess` is a context manager: the server runs in its own process group, `stop` asks it to
exit (SIGTERM, `--exit-timeout-secs`), then kills the whole group, so no stub process outlives it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from specserve.methods import renamed
from specserve.prepare import repo_root

EXIT_TIMEOUT_S = 10


def default_repository() -> Path:
    return repo_root() / "model_repository"


def list_variants(repository: Path) -> list[str]:
    """Variants with a decoupled model `llm_<v>` and its ensemble `ensemble_<v>`."""
    return sorted(
        p.name.removeprefix("llm_")
        for p in repository.glob("llm_*")
        if (p / "config.pbtxt").is_file() and (repository / f"ensemble_{p.name.removeprefix('llm_')}" / "config.pbtxt").is_file()
    )


def models_for(variants: Iterable[str]) -> list[str]:
    """What `--load-model` needs for these variants: preprocessing, then each llm model + its ensemble."""
    models = ["preprocessing"]
    for v in variants:
        models += [f"llm_{v}", f"ensemble_{v}"]
    return models


# ---- locating the server --------------------------------------------------------------------


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
    cache_root = cache_root or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specserve" / "tritonserver"
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


# ---- the process ----------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonProcess:
    """A tritonserver in its own process group; `with TritonProcess(...) as server:` waits until ready.

    log: a path (the server's stdout+stderr go there), or None to inherit this process's.
    """

    def __init__(
        self,
        repository: Path,
        models: Sequence[str],
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        log: Path | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 1800.0,  # a first start on a CPU compiles its programs (minutes on 2 cores)
    ) -> None:
        self.repository = Path(repository).resolve()
        self.models = list(models)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.log = log
        self.extra_args = list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.shm_prefix = f"specserve{os.getpid()}_{http_port}_"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

    def command(self, install: TritonInstall) -> list[str]:
        cmd = [
            str(install.binary),
            f"--model-repository={self.repository}",
            "--model-control-mode=explicit",
            *(f"--load-model={m}" for m in self.models),
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            # every model starts loading at once (Triton's default is 4 at a time)
            f"--model-load-thread-count={max(4, len(self.models))}",
            # two servers on one host must not share the Python backend's shared-memory regions
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        if install.backend_dir is not None:
            cmd.append(f"--backend-directory={install.backend_dir}")
        return cmd + self.extra_args

    def start(self) -> None:
        install = find_tritonserver()
        out: IO[bytes] | None = None
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = out = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.command(install),
            env={**os.environ, **install.env},
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,  # its own process group: stop() can kill the stubs too
        )

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float | None = None) -> None:
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + (timeout_s or self.startup_timeout_s)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode} while starting{self._log_hint()}")
            if self.is_ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout_s or self.startup_timeout_s:.0f}s{self._log_hint()}")

    def _log_hint(self) -> str:
        if self.log is None or not self.log.is_file():
            return ""
        tail = self.log.read_text(errors="replace")[-4000:]
        return f"; log {self.log}:\n{tail}"

    def stop(self) -> int | None:
        """SIGTERM, wait for the server's own exit timeout, then SIGKILL the whole group."""
        if self.proc is None:
            return None
        proc, pgid = self.proc, self.proc.pid  # start_new_session: pgid == pid
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(EXIT_TIMEOUT_S + 20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(pgid, signal.SIGKILL)  # the server if still alive, and any stub it left
        except ProcessLookupError:
            pass
        proc.wait()
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):  # left behind after a kill
            region.unlink(missing_ok=True)
        if self._log_file is not None:
            self._log_file.close()
        return proc.returncode

    def __enter__(self) -> TritonProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- a repository copy with other parameters ------------------------------------------------

_PARAM = r'(parameters:\s*\{{\s*key:\s*"{key}"\s*value:\s*\{{\s*string_value:\s*")([^"]*)(")'


def read_parameters(config_pbtxt: Path) -> dict[str, str]:
    """The `parameters` of a config.pbtxt written in this repository's one-line style."""
    pattern = re.compile(r'parameters:\s*\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"')
    return dict(pattern.findall(Path(config_pbtxt).read_text()))


def copy_repository(src: Path, dst: Path, overrides: Mapping[str, Mapping[str, str]] | None = None) -> Path:
    """Copy a model repository, setting config.pbtxt parameters: {model: {key: value}}."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    for model, params in (overrides or {}).items():
        path = dst / model / "config.pbtxt"
        text = path.read_text()
        for key, value in params.items():
            pattern = re.compile(_PARAM.format(key=re.escape(key)))
            if pattern.search(text):
                text = pattern.sub(lambda m, v=value: m.group(1) + v + m.group(3), text)
            else:
                text += f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
        path.write_text(text)
    return dst


# ---- `specserve serve` ----------------------------------------------------------------------


def serve(
    repository: Path | None = None,
    variants: list[str] | None = None,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    parameters: Mapping[str, str] | None = None,
    log: Path | None = None,
) -> int:
    """Run tritonserver until Ctrl-C / SIGTERM; returns an exit code.

    parameters: config.pbtxt parameters set on every served llm_<variant>, on a temporary copy of
    the repository (the repository itself is not written). log: tritonserver's output goes there.
    """
    repository = Path(repository or default_repository())
    available = list_variants(repository)
    chosen = available if variants is None else [renamed(v) for v in variants]  # base -> none, ...
    missing = [v for v in chosen if v not in available]
    if missing or not chosen:
        print(f"serve: unknown variant(s) {missing or chosen}; {repository} has {available}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="specserve-serve-") as tmp:
        if parameters:
            overrides = {f"llm_{v}": dict(parameters) for v in chosen}
            repository = copy_repository(repository, Path(tmp) / "model_repository", overrides)
        return _run_until_stopped(TritonProcess(repository, models_for(chosen), http_port, grpc_port, metrics_port,
                                                log=log), chosen)


def _run_until_stopped(server: TritonProcess, chosen: list[str]) -> int:
    """Start `server`, say where it listens once ready (with its pid), stop it on SIGINT / SIGTERM."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        print(f"serve: starting tritonserver for {', '.join(chosen)} ...", flush=True)
        while not server.is_ready():
            if stop.wait(0.5):
                return 130
            if server.proc is not None and server.proc.poll() is not None:
                print(f"serve: tritonserver exited with code {server.proc.returncode}", file=sys.stderr)
                return server.proc.returncode or 1
        assert server.proc is not None
        print(
            f"serve: ready (tritonserver pid {server.proc.pid})\n"
            f"  HTTP     http://{server.http_url}  (POST /v2/models/llm_<variant>/generate_stream)\n"
            f"  gRPC     {server.grpc_url}\n  metrics  {server.metrics_url}\n"
            f"  models   {', '.join(f'llm_{v}' for v in chosen)}\nCtrl-C to stop.",
            flush=True,
        )
        while not stop.wait(0.5):
            if server.proc is not None and server.proc.poll() is not None:
                print(f"serve: tritonserver exited with code {server.proc.returncode}", file=sys.stderr)
                return server.proc.returncode or 1
        print("serve: stopping ...", flush=True)
        return 0
    finally:
        server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
