"""Start a real `tritonserver` on the model repository (`specserve serve`, the e2e tests, benchmarks).

Which server: `tritonserver` on PATH (an NGC container) or else the copy inside the
`nvidia-pytriton` wheel. The wheel's copy needs a backend directory holding the Python-backend stub
for the running interpreter next to `libtriton_python.so`; it is assembled once under a cache
directory. The stub's embedded interpreter finds this virtualenv's packages because the venv's
`bin/` is first on its PATH.

`TritonProcess` is a context manager: the server runs in its own process group, `stop` drains the
llm models (`drain`: new requests refused, every open stream ended within `shutdown_grace_s`, each
with its FINAL), asks the server to exit (SIGTERM, `--exit-timeout-secs`), then kills the whole
group, so no stub process outlives it.
Started from the main thread, the server also gets the kernel's parent-death signal (SIGKILL): it
never outlives the process that started it, even one killed outright; the Python-backend stubs see
their parent gone and exit by themselves.

Exposure: the admin APIs (model load/unload, shared-memory registration, trace and log settings)
answer only requests that carry the admin key (`admin_headers`); health, metadata, model config,
statistics and inference stay open to whoever reaches the ports. The endpoints bind `host`
(Triton's default: every interface). This module neither authenticates inference nor encrypts traffic.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO

from specserve.host_memory import huge_page_env
from specserve.methods import renamed
from specserve.prepare import repo_root
from specserve.serving.drain import DRAIN_FILE_ENV, request_drain, wait_drained
from specserve.serving.exposure import (
    ADMIN_HEADER,
    ADMIN_KEY_ENV,
    ALL_INTERFACES,
    GRPC_ADMIN_HEADER,
    RESTRICTED_APIS,
    Exposure,
    check_admin_key,
    check_host,
    client_host,
    port_problems,
)
from specserve.serving.install import TritonInstall, find_tritonserver

EXIT_TIMEOUT_S = 10  # tritonserver's own wait for in-flight requests and unloading
SHUTDOWN_GRACE_S = 5.0  # open streams may finish this long after a stop; the rest end "shutting down"
MAX_SHUTDOWN_GRACE_S = 3600.0
DRAIN_MARGIN_S = 2.0  # past the grace, the models' aborts and FINALs go out
PR_SET_PDEATHSIG = 1  # prctl(2)


def default_repository() -> Path:
    return repo_root() / "model_repository"


def list_variants(repository: Path) -> list[str]:
    """Variants with a decoupled model `llm_<v>` and its ensemble `ensemble_<v>`."""
    return sorted(
        p.name.removeprefix("llm_")
        for p in repository.glob("llm_*")
        if (p / "config.pbtxt").is_file()
        and (repository / f"ensemble_{p.name.removeprefix('llm_')}" / "config.pbtxt").is_file()
    )


def models_for(variants: Iterable[str]) -> list[str]:
    """What `--load-model` needs for these variants: preprocessing, then each llm model + its ensemble."""
    models = ["preprocessing"]
    for v in variants:
        models += [f"llm_{v}", f"ensemble_{v}"]
    return models


# ---- dying with the parent ------------------------------------------------------------------


def _prctl() -> Callable[..., int] | None:
    """libc's prctl (Linux), looked up before any fork; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent(prctl: Callable[..., int], sig: int, parent_pid: int) -> None:
    """Have the kernel send `sig` to this process when its parent's forking thread ends; if the
    parent is already gone (it died before the request took effect), send it now."""
    prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def signal_on_parent_exit(sig: int = signal.SIGTERM) -> bool:
    """Receive `sig` when this process's parent ends (what `specserve serve --exit-with-parent`
    does, so that its handler stops tritonserver). False where the platform cannot (not Linux)."""
    prctl = _prctl()
    if prctl is None:
        return False
    _die_with_parent(prctl, sig, os.getppid())
    return True


def _child_dies_with_this_thread() -> Callable[[], None] | None:
    """A `preexec_fn` giving the child SIGKILL when this process ends; None off Linux or off the
    main thread (the kernel signals when the forking *thread* ends, which may be long before)."""
    prctl = _prctl()
    if prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    return functools.partial(_die_with_parent, prctl, signal.SIGKILL, os.getpid())


# ---- the process ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonProcess:
    """A tritonserver in its own process group; `with TritonProcess(...) as server:` waits until ready.

    log: a path (the server's stdout+stderr go there), or None to inherit this process's.
    host: the address of the HTTP, gRPC and metrics endpoints. admin_key: what the admin APIs require
    (None: a random one per server); open_admin_api: no key at all (Triton's default).
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
        host: str = ALL_INTERFACES,
        admin_key: str | None = None,
        open_admin_api: bool = False,
        shutdown_grace_s: float = SHUTDOWN_GRACE_S,
    ) -> None:
        if not 0 <= shutdown_grace_s <= MAX_SHUTDOWN_GRACE_S:
            raise ValueError(f"shutdown grace must be within 0..{MAX_SHUTDOWN_GRACE_S:.0f} s, got {shutdown_grace_s}")
        self.shutdown_grace_s = shutdown_grace_s
        self.repository = Path(repository).resolve()
        self.models = list(models)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.log = log
        self.extra_args = list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.host = check_host(host)
        if open_admin_api and admin_key is not None:
            raise ValueError("an admin key and an open admin API exclude each other")
        self.admin_key = None if open_admin_api else check_admin_key(admin_key or secrets.token_urlsafe(32))
        self.shm_prefix = f"specserve{os.getpid()}_{http_port}_"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._drain_dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def admin_headers(self) -> dict[str, str]:
        """Headers that open the admin APIs, for tritonclient's `headers=` over HTTP and gRPC alike."""
        if self.admin_key is None:
            return {}
        return {ADMIN_HEADER: self.admin_key, GRPC_ADMIN_HEADER: self.admin_key}

    @property
    def http_url(self) -> str:
        return f"{client_host(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{client_host(self.host)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{client_host(self.host)}:{self.metrics_port}/metrics"

    def _exposure_args(self) -> list[str]:
        """Addresses of the three endpoints, and the admin APIs restricted to the key."""
        args = [f"--{endpoint}-address={self.host}" for endpoint in ("http", "grpc", "metrics")]
        if self.admin_key is not None:
            restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={self.admin_key}"
            args += [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]
        return args

    @property
    def drain_file(self) -> Path | None:
        """Where `stop` writes the models' deadline (see `specserve.serving.drain`); None before `start`."""
        return None if self._drain_dir is None else Path(self._drain_dir.name) / "drain"

    def command(self, install: TritonInstall) -> list[str]:
        cmd = [
            str(install.binary),
            f"--model-repository={self.repository}",
            "--model-control-mode=explicit",
            *(f"--load-model={m}" for m in self.models),
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            *self._exposure_args(),
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
        self._drain_dir = tempfile.TemporaryDirectory(prefix="specserve-drain-")
        self.proc = subprocess.Popen(
            self.command(install),
            env=huge_page_env({**os.environ, **install.env, DRAIN_FILE_ENV: str(self.drain_file)}),
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,  # its own process group: stop() can kill the stubs too
            preexec_fn=_child_dies_with_this_thread(),
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
                raise RuntimeError(
                    f"tritonserver exited with code {self.proc.returncode} while starting{self._log_hint()}"
                )
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
        """Drain the llm models (open streams get `shutdown_grace_s`), SIGTERM, wait for the
        server's own exit timeout, then SIGKILL the whole group."""
        if self.proc is None:
            return None
        proc, pgid = self.proc, self.proc.pid  # start_new_session: pgid == pid
        if proc.poll() is None:
            self._drain(proc)
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
        if self._drain_dir is not None:
            self._drain_dir.cleanup()
        return proc.returncode

    def _drain(self, proc: subprocess.Popen[bytes]) -> None:
        """Write the drain file and wait until every llm model has drained, at most the grace and
        a little more (a model that failed to load never answers)."""
        if self.drain_file is None:
            return
        request_drain(self.drain_file, self.shutdown_grace_s)
        llm_models = [m for m in self.models if m.startswith("llm_")]
        wait_drained(self.drain_file, llm_models, self.shutdown_grace_s + DRAIN_MARGIN_S,
                     keep_waiting=lambda: proc.poll() is None)

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
    exposure: Exposure = Exposure(),
    exit_with_parent: bool = False,
    shutdown_grace_s: float = SHUTDOWN_GRACE_S,
) -> int:
    """Run tritonserver until Ctrl-C / SIGTERM; returns an exit code (2: refused to start).

    parameters: config.pbtxt parameters set on every served llm_<variant>, on a temporary copy of
    the repository (the repository itself is not written). log: tritonserver's output goes there.
    exit_with_parent: stop (as on SIGTERM) when the process that started this one ends.
    shutdown_grace_s: how long open streams may go on once stopping (see `TritonProcess.stop`).
    """
    repository = Path(repository or default_repository())
    available = list_variants(repository)
    chosen = available if variants is None else [renamed(v) for v in variants]  # base -> none, ...
    missing = [v for v in chosen if v not in available]
    if missing or not chosen:
        print(f"serve: unknown variant(s) {missing or chosen}; {repository} has {available}", file=sys.stderr)
        return 2
    try:
        exposure = exposure.check()
    except ValueError as e:
        print(f"serve: {e}", file=sys.stderr)
        return 2
    if _refuse_taken_ports(exposure.host, http_port, grpc_port, metrics_port):
        return 2
    with tempfile.TemporaryDirectory(prefix="specserve-serve-") as tmp:
        if parameters:
            overrides = {f"llm_{v}": dict(parameters) for v in chosen}
            repository = copy_repository(repository, Path(tmp) / "model_repository", overrides)
        try:
            server = TritonProcess(repository, models_for(chosen), http_port, grpc_port, metrics_port, log=log,
                                   host=exposure.host, admin_key=exposure.admin_key,
                                   open_admin_api=exposure.open_admin_api, shutdown_grace_s=shutdown_grace_s)
        except ValueError as e:
            print(f"serve: {e}", file=sys.stderr)
            return 2
        return _run_until_stopped(server, chosen, exposure, exit_with_parent)


def _refuse_taken_ports(host: str, http_port: int, grpc_port: int, metrics_port: int) -> bool:
    """Say which ports cannot be bound (and the flag that moves each); True if any."""
    ports = {"HTTP": http_port, "gRPC": grpc_port, "metrics": metrics_port}
    problems = port_problems(host, ports)
    for problem in problems:
        print(f"serve: {problem}; is another server running? (--http-port, --grpc-port, --metrics-port "
              "choose others)", file=sys.stderr)
    return bool(problems)


def _ready_message(server: TritonProcess, chosen: list[str], exposure: Exposure) -> str:
    """What `specserve serve` prints once tritonserver is ready: where it listens, the admin key."""
    assert server.proc is not None
    every = server.host == ALL_INTERFACES
    bound = " (every interface; --host 127.0.0.1 for this machine only)" if every else ""
    return (
        f"serve: ready (tritonserver pid {server.proc.pid})\n"
        f"  HTTP     http://{server.http_url}  (POST /v2/models/llm_<variant>/generate_stream)\n"
        f"  gRPC     {server.grpc_url}\n  metrics  {server.metrics_url}\n"
        f"  bound    {server.host}{bound}\n"
        f"  models   {', '.join(f'llm_{v}' for v in chosen)}\n"
        f"  admin    {_admin_line(server, exposure)}\nCtrl-C to stop."
    )


def _admin_line(server: TritonProcess, exposure: Exposure) -> str:
    """How to reach the admin APIs: the generated key itself (printed once), or where the key came from."""
    apis = "model load/unload, shared memory, trace and log settings"
    if server.admin_key is None:
        return f"{apis} open to every client (--open-admin-api)"
    key = f"the key given ({ADMIN_KEY_ENV} or --admin-key)" if exposure.admin_key else server.admin_key
    return f"{apis} need header {ADMIN_HEADER} (HTTP) or {GRPC_ADMIN_HEADER} (gRPC): {key}"


def _run_until_stopped(server: TritonProcess, chosen: list[str], exposure: Exposure = Exposure(),
                       exit_with_parent: bool = False) -> int:
    """Start `server`, say where it listens once ready (with its pid), stop it on SIGINT / SIGTERM
    (and, with exit_with_parent, when this process's parent ends)."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if exit_with_parent and not signal_on_parent_exit(signal.SIGTERM):
            print("serve: --exit-with-parent works on Linux only; ignored", file=sys.stderr)
        if stop.is_set():  # the parent was already gone
            return 130
        server.start()
        print(f"serve: starting tritonserver for {', '.join(chosen)} ...", flush=True)
        while not server.is_ready():
            if stop.wait(0.5):
                return 130
            if server.proc is not None and server.proc.poll() is not None:
                print(f"serve: tritonserver exited with code {server.proc.returncode}", file=sys.stderr)
                return server.proc.returncode or 1
        print(_ready_message(server, chosen, exposure), flush=True)
        while not stop.wait(0.5):
            if server.proc is not None and server.proc.poll() is not None:
                print(f"serve: tritonserver exited with code {server.proc.returncode}", file=sys.stderr)
                return server.proc.returncode or 1
        print(f"serve: stopping (open streams get {server.shutdown_grace_s:g} s to finish) ...", flush=True)
        code = server.stop()
        print(f"serve: tritonserver exited with code {code}", flush=True)
        return 0 if code == 0 else 1
    finally:
        server.stop()  # at once after a start that failed or was interrupted; nothing after a stop
        for s, handler in previous.items():
            signal.signal(s, handler)
