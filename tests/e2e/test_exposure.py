"""End-to-end exposure of a real tritonserver: the admin APIs (model load, shared-memory registration,
log settings) refuse requests without the admin key over HTTP and gRPC and accept them with it;
nothing of a `specserve serve` (tritonserver, its Python-backend stubs) outlives the command or
`make serve` stopped by SIGTERM or killed by SIGKILL; and `specserve serve` refuses a taken port
before it starts anything. Every server runs llm_none with eager forwards (quick to start)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serving_helpers import children, descendants
from tritonclient.utils import InferenceServerException

from specserve.prepare import repo_root
from specserve.serving.server import TritonProcess, copy_repository, default_repository, free_port, models_for

pytestmark = pytest.mark.e2e

READY = re.compile(r"serve: ready \(tritonserver pid (\d+)\)")
START_TIMEOUT_S = 300
GONE_WITHIN_S = 10
CLIENTS = {"http": httpclient.InferenceServerClient, "grpc": grpcclient.InferenceServerClient}
# a model whose model.py comes with the request: what an open model-repository API would run
FOREIGN_MODEL = {"config": json.dumps({"backend": "python"}),
                 "files": {"file:1/model.py": b"raise SystemExit\n"}}


@pytest.fixture(scope="module")
def params(engine_params: dict[str, str]) -> dict[str, str]:
    """llm_none's parameters here: the e2e limits, eager forwards (what is tested is not the forward)."""
    return engine_params | {"disable_cpu_compile": "true"}


@pytest.fixture(scope="class")  # gone before the tests below start servers of their own
def server(tmp_path_factory: pytest.TempPathFactory, params: dict[str, str]) -> Iterator[TritonProcess]:
    root = tmp_path_factory.mktemp("triton-exposure")
    repo = copy_repository(default_repository(), root / "model_repository",
                           {"llm_none": params, "preprocessing": {"max_seq_len": params["max_seq_len"]}})
    with TritonProcess(repo, models_for(["none"]), free_port(), free_port(), free_port(),
                       log=root / "tritonserver.log", host="127.0.0.1") as process:
        yield process


def _client(server: TritonProcess, protocol: str):
    return CLIENTS[protocol](server.http_url if protocol == "http" else server.grpc_url)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
class TestTheAdminApis:
    def test_refuse_requests_without_the_key(self, server: TritonProcess, protocol: str):
        client = _client(server, protocol)
        wrong = {name: "w" * 32 for name in server.admin_headers}
        refused: dict[str, Callable[[], object]] = {
            "load": lambda: client.load_model("llm_none"),
            "load with a wrong key": lambda: client.load_model("llm_none", headers=wrong),
            "load of a model sent along": lambda: client.load_model("foreign", **FOREIGN_MODEL),
            "unload": lambda: client.unload_model("llm_none"),
            "shared memory": lambda: client.register_system_shared_memory("region", "/specserve_region", 64),
            "log settings": lambda: client.update_log_settings({"log_verbose_level": 1}),
        }
        try:
            answers = {what: _refusal(call) for what, call in refused.items()}
            assert all("restricted" in answer for answer in answers.values()), answers
            assert client.is_model_ready("llm_none"), "health stays open"
            assert client.get_model_metadata("llm_none"), "metadata stays open"
        finally:
            client.close()

    def test_accept_them_with_the_key(self, server: TritonProcess, protocol: str):
        client = _client(server, protocol)
        try:
            client.load_model("llm_none", headers=server.admin_headers)
            assert client.is_model_ready("llm_none")
        finally:
            client.close()


def _refusal(call: Callable[[], object]) -> str:
    """The server's answer to a request that should be refused: its error message, or `accepted`."""
    try:
        call()
    except InferenceServerException as e:
        return e.message()
    return "accepted"


# ---- nothing outlives `specserve serve` -----------------------------------------------------


def _serve_args(params: dict[str, str], log: Path) -> list[str]:
    """`specserve serve` flags: llm_none on free loopback ports with these parameters."""
    args = ["--host", "127.0.0.1", "--http-port", str(free_port()), "--grpc-port", str(free_port()),
            "--metrics-port", str(free_port()), "--log", str(log)]
    for key, value in params.items():
        args += ["--parameter", f"{key}={value}"]
    return args


def _specserve() -> str:
    """This environment's `specserve` command."""
    return str(Path(sys.executable).with_name("specserve"))


def _specserve_serve(params: dict[str, str], tmp: Path) -> list[str]:
    return [_specserve(), "serve", "--variants", "none", *_serve_args(params, tmp / "tritonserver.log")]


def _make_serve(params: dict[str, str], tmp: Path) -> list[str]:
    """`make serve` of the project's Makefile; -o: the set-up (done before any test runs) is not redone."""
    venv = Path(sys.executable).parent.parent
    return ["make", "--no-print-directory", "-C", str(repo_root()), "-o", f"{venv}/.specserve-setup",
            "-o", "models/SmolLM2-135M-Instruct/model.safetensors", "serve", f"VENV={venv}", "VARIANTS=none",
            f"SERVE_ARGS={' '.join(_serve_args(params, tmp / 'tritonserver.log'))}"]


STARTERS = {"specserve serve": _specserve_serve, "make serve": _make_serve}


def _alive(pid: int) -> bool:
    """Running (a zombie whose parent is gone counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_ready(proc: subprocess.Popen, said: Path) -> int:
    """tritonserver's pid once the starter says it is ready."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if m := READY.search(said.read_text(errors="replace")):
            return int(m.group(1))
        said_so_far = said.read_text(errors="replace")[-3000:]
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{said_so_far}"
        time.sleep(0.2)
    raise TimeoutError(f"not ready after {START_TIMEOUT_S}s")


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("starter", list(STARTERS))
def test_nothing_outlives_the_command(starter: str, sig: signal.Signals, params: dict[str, str],
                                      tmp_path: Path):
    if starter == "make serve" and shutil.which("make") is None:
        pytest.skip("no make here")
    said = tmp_path / "said"
    with open(said, "wb") as out:
        proc = subprocess.Popen(STARTERS[starter](params, tmp_path), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    tree: list[int] = []
    try:
        tritonserver = _wait_ready(proc, said)
        tree = descendants(proc.pid)
        assert tritonserver in tree and children(tritonserver), "tritonserver and its stubs should run"
        os.kill(proc.pid, sig)
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(_alive(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in tree if _alive(pid)}
        assert not survivors, f"alive {GONE_WITHIN_S}s after {sig.name} to {starter}: {survivors}"
    finally:
        _kill_all([proc.pid, *tree])
        proc.wait()


def test_serve_refuses_a_taken_http_port_at_once(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [_specserve(), "serve", "--variants", "none", "--host", "127.0.0.1", "--http-port", str(port),
               "--grpc-port", str(free_port()), "--metrics-port", str(free_port())]
        started = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    assert f"the HTTP port {port} on 127.0.0.1 is not free" in done.stderr and "--http-port" in done.stderr
    assert "starting tritonserver" not in done.stdout
    assert took < 15, f"took {took:.1f}s"
