"""A tritonserver for one variant, started here unless the caller already has one (benchmarks).

The server is started by running the server package's `specserve serve` command, never by
importing it: `specserve_client` imports nothing of `specserve`, and a client-only install gets a
clear error naming what it lacks. The server listens on the loopback address only and ends with
the process that started it, even one killed outright. This module does not wait for a model to
switch to its compiled programs; a server is ready when Triton says so.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

READY = re.compile(r"serve: ready \(tritonserver pid (\d+)\)")
LOOPBACK = "127.0.0.1"  # a local server listens on this machine only
STOP_TIMEOUT_S = 60.0  # `specserve serve` gives tritonserver its exit timeout, then kills it


@dataclass(frozen=True)
class LocalServer:
    grpc_url: str
    metrics_url: str
    pid: int  # tritonserver's process (its resident memory is the server's)


def specserve_command() -> str:
    """The `specserve` command of this environment (beside this interpreter, else on PATH)."""
    beside = Path(sys.executable).with_name("specserve")
    found = str(beside) if beside.is_file() else shutil.which("specserve")
    if found is None:
        raise FileNotFoundError(
            "starting a tritonserver here needs the server package's `specserve` command (install the project "
            "root); where a command takes --url, point it at a running server instead")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def add_server_arguments(p: argparse.ArgumentParser, num_threads_help: str) -> None:
    """--url / --repository / --num-threads: the flags `server_for` and its callers share."""
    p.add_argument("--url", help="gRPC host:port of a running server (default: start one here)")
    p.add_argument("--repository", type=Path, help="model repository (default: the project's)")
    p.add_argument("--num-threads", type=int, help=num_threads_help)


@contextmanager
def local_server(
    variant: str,
    repository: Path | None = None,
    parameters: Mapping[str, str] | None = None,
    log: Path | None = None,
    startup_timeout_s: float = 1800.0,  # a first start on a CPU compiles its programs (minutes on 2 cores)
) -> Iterator[LocalServer]:
    """`specserve serve` for llm_<variant> on free loopback ports, stopped (SIGTERM) when the block ends.

    parameters: config.pbtxt parameters of llm_<variant> for this run (on a temporary copy).
    log: where tritonserver's output goes (default: a temporary file, quoted if the start fails).
    """
    http, grpc, metrics = (free_port() for _ in range(3))
    with tempfile.TemporaryDirectory(prefix="specserve-local-") as tmp:
        log = Path(log or Path(tmp) / "tritonserver.log")
        said = Path(tmp) / "serve.out"
        cmd = serve_command(variant, (http, grpc, metrics), log, repository, parameters)
        with open(said, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        pid = None
        try:
            pid = _wait_ready(proc, said, log, startup_timeout_s)
            yield LocalServer(f"{LOOPBACK}:{grpc}", f"http://{LOOPBACK}:{metrics}/metrics", pid)
        finally:
            _stop(proc, pid)


def serve_command(variant: str, ports: tuple[int, int, int], log: Path, repository: Path | None = None,
                  parameters: Mapping[str, str] | None = None) -> list[str]:
    """The `specserve serve` command line for llm_<variant> on (HTTP, gRPC, metrics) ports of this machine;
    it ends with the process that runs it, even one killed outright."""
    http, grpc, metrics = ports
    cmd = [specserve_command(), "serve", "--variants", variant, "--host", LOOPBACK, "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--log", str(log), "--exit-with-parent"]
    if repository is not None:
        cmd += ["--model-repository", str(repository)]
    for key, value in (parameters or {}).items():
        cmd += ["--parameter", f"{key}={value}"]
    return cmd


def _wait_ready(proc: subprocess.Popen, said: Path, log: Path, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if m := READY.search(said.read_text(errors="replace")):
            return int(m.group(1))
        if proc.poll() is not None:
            raise RuntimeError(f"`specserve serve` exited with code {proc.returncode} while starting:\n"
                               f"{said.read_text(errors='replace')[-2000:]}{_tail(log)}")
        time.sleep(0.5)
    raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f}s{_tail(log)}")


def _tail(log: Path) -> str:
    return f"\nlog {log}:\n{log.read_text(errors='replace')[-4000:]}" if log.is_file() else ""


def _stop(proc: subprocess.Popen, tritonserver_pid: int | None) -> None:
    """SIGTERM to `specserve serve` (which stops tritonserver); both process groups killed if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    for group in (proc.pid, tritonserver_pid):  # each runs in a session of its own: pgid == pid
        if group is not None:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


@contextmanager
def server_for(
    variant: str,
    url: str | None = None,
    repository: Path | None = None,
    overrides: Mapping[str, str] | None = None,
    log: Path | None = None,
) -> Iterator[str]:
    """Yield the gRPC url: `url` as given, or a fresh local server's.

    overrides: config.pbtxt parameters of llm_<variant> for this run (on a temporary copy).
    """
    if url is not None:
        yield url
        return
    with local_server(variant, repository, overrides, log) as server:
        yield server.grpc_url
