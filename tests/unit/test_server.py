"""The tritonserver launcher's parts that need no server: repository discovery, command line (admin
key, addresses), parameter copies, the port check, processes that end with their parent."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specserve.serving.server import (
    ADMIN_HEADER,
    ADMIN_KEY_ENV,
    GRPC_ADMIN_HEADER,
    TritonInstall,
    TritonProcess,
    copy_repository,
    default_repository,
    list_variants,
    models_for,
    port_problems,
    read_parameters,
)

INSTALL = TritonInstall(Path("/bin/tritonserver"), None, {})
RESTRICTED = "model-repository,shared-memory,trace,logging"


def test_variants_and_models():
    variants = list_variants(default_repository())
    assert "none" in variants
    assert models_for(["none", "ngram"]) == ["preprocessing", "llm_none", "ensemble_none", "llm_ngram",
                                             "ensemble_ngram"]


def test_command_line():
    p = TritonProcess(Path("/repo"), ["preprocessing", "llm_none", "ensemble_none"], 1, 2, 3)
    cmd = p.command(TritonInstall(Path("/bin/tritonserver"), Path("/cache/backends"), {}))
    assert cmd[0] == "/bin/tritonserver"
    assert "--model-control-mode=explicit" in cmd
    assert [c for c in cmd if c.startswith("--load-model=")] == [
        "--load-model=preprocessing", "--load-model=llm_none", "--load-model=ensemble_none"
    ]
    assert {"--http-port=1", "--grpc-port=2", "--metrics-port=3", "--backend-directory=/cache/backends"} <= set(cmd)
    assert any(c.startswith("--exit-timeout-secs=") for c in cmd)
    # the llm models' tensors come from their auto_complete_config: auto-complete stays on
    assert not any(c.startswith(("--disable-auto-complete-config", "--strict-model-config")) for c in cmd)
    other = TritonProcess(Path("/repo"), [], 4, 5, 6).command(TritonInstall(Path("/bin/tritonserver"), None, {}))
    shm = {c for c in cmd + other if "shm-region-prefix-name=" in c}
    assert len(shm) == 2, "two servers on one host need distinct shared-memory prefixes"


def test_admin_apis_need_a_random_key_per_server_by_default():
    one, two = (TritonProcess(Path("/repo"), [], 1, 2, 3) for _ in range(2))
    assert one.admin_key != two.admin_key and len(one.admin_key) >= 32
    cmd = one.command(INSTALL)
    assert f"--http-restricted-api={RESTRICTED}:{ADMIN_HEADER}={one.admin_key}" in cmd
    assert f"--grpc-restricted-protocol={RESTRICTED}:{ADMIN_HEADER}={one.admin_key}" in cmd
    assert one.admin_headers == {ADMIN_HEADER: one.admin_key, GRPC_ADMIN_HEADER: one.admin_key}


def test_a_given_admin_key_is_used_and_checked():
    key = "k" * 16
    assert f"--http-restricted-api={RESTRICTED}:{ADMIN_HEADER}={key}" in TritonProcess(
        Path("/repo"), [], admin_key=key).command(INSTALL)
    for bad in ("short", "has space in it here", "a:b=c,d" * 4):
        with pytest.raises(ValueError, match="admin key"):
            TritonProcess(Path("/repo"), [], admin_key=bad)
    with pytest.raises(ValueError, match="exclude"):
        TritonProcess(Path("/repo"), [], admin_key=key, open_admin_api=True)


def test_an_open_admin_api_has_no_restriction():
    p = TritonProcess(Path("/repo"), [], open_admin_api=True)
    assert not any("restricted" in c for c in p.command(INSTALL))
    assert (p.admin_key, p.admin_headers) == (None, {})


def test_the_endpoints_bind_the_host():
    default = TritonProcess(Path("/repo"), [], 1, 2, 3).command(INSTALL)
    assert {"--http-address=0.0.0.0", "--grpc-address=0.0.0.0", "--metrics-address=0.0.0.0"} <= set(default)
    local = TritonProcess(Path("/repo"), [], 1, 2, 3, host="127.0.0.1")
    assert {"--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"} <= set(
        local.command(INSTALL))
    assert (local.http_url, local.grpc_url, local.metrics_url) == (
        "127.0.0.1:1", "127.0.0.1:2", "http://127.0.0.1:3/metrics")
    with pytest.raises(ValueError, match="IPv4"):
        TritonProcess(Path("/repo"), [], host="example.com")


def _listening() -> socket.socket:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    return taken


def test_port_problems_name_a_port_in_use_and_a_port_given_twice():
    with _listening() as taken:
        port = taken.getsockname()[1]
        problems = port_problems("127.0.0.1", {"HTTP": port, "gRPC": 0, "metrics": 0})
    assert len(problems) == 2
    assert problems[0].startswith(f"the HTTP port {port} on 127.0.0.1 is not free")
    assert problems[1] == "the metrics port 0 is also the gRPC port"
    assert port_problems("127.0.0.1", {"HTTP": port}) == []  # closed again


def test_serve_refuses_a_taken_port_before_starting_anything(monkeypatch, capsys):
    import specserve.serving.server as server

    monkeypatch.setattr(server, "_run_until_stopped", lambda *_: pytest.fail("started a server"))
    with _listening() as taken:
        port = taken.getsockname()[1]
        assert server.serve(None, ["none"], 0, port, 1, exposure=server.Exposure(host="127.0.0.1")) == 2
    err = capsys.readouterr().err
    assert f"the gRPC port {port} on 127.0.0.1 is not free" in err and "--grpc-port" in err


def _serve_sees(monkeypatch, argv: list[str]) -> TritonProcess:
    """The TritonProcess `specserve serve --variants none argv...` would run."""
    import specserve.serving.server as server
    from specserve.cli import main

    seen = []
    monkeypatch.setattr(server, "port_problems", lambda *_: [])
    monkeypatch.setattr(server, "_run_until_stopped", lambda process, *_: seen.append(process) or 0)
    assert main(["serve", "--variants", "none", *argv]) == 0
    return seen[0]


def test_serve_takes_the_admin_key_from_the_environment_or_the_flag(monkeypatch):
    monkeypatch.setenv(ADMIN_KEY_ENV, "e" * 20)
    assert _serve_sees(monkeypatch, []).admin_key == "e" * 20
    assert _serve_sees(monkeypatch, ["--admin-key", "f" * 20]).admin_key == "f" * 20
    monkeypatch.delenv(ADMIN_KEY_ENV)
    process = _serve_sees(monkeypatch, ["--open-admin-api", "--host", "127.0.0.1"])
    assert (process.admin_key, process.host) == (None, "127.0.0.1")


def test_serve_refuses_an_open_admin_api_with_a_key(monkeypatch, capsys):
    from specserve.cli import main

    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    assert main(["serve", "--variants", "none", "--open-admin-api", "--admin-key", "k" * 16]) == 2
    assert "exclude each other" in capsys.readouterr().err


# A parent that starts a child the way TritonProcess starts tritonserver, says its pid, then waits.
STARTS_LIKE_TRITONSERVER = """
import subprocess, sys, time
from specserve.serving import server
dies_with_parent = server._child_dies_with_this_thread()
child = subprocess.Popen(["sleep", "60"], start_new_session=True, preexec_fn=dies_with_parent)
print(child.pid, flush=True)
time.sleep(60)
"""
# A parent whose child asks for SIGTERM when it ends (`serve --exit-with-parent`), then writes `armed`.
CHILD_ASKS_FOR_SIGTERM = """
import subprocess, sys, time
code = '''
import pathlib, signal, sys, time
from specserve.serving import server
said = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: (said.write_text("SIGTERM"), sys.exit(0)))
server.signal_on_parent_exit(signal.SIGTERM)
said.write_text("armed")
time.sleep(60)
'''
child = subprocess.Popen([sys.executable, "-c", code, sys.argv[1]], start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""


def _start_parent(script: str, *args: str) -> tuple[subprocess.Popen, int]:
    """Run `script`; it and the pid of the child it printed."""
    parent = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    return parent, int(parent.stdout.readline())


def _gone(pid: int, timeout_s: float) -> bool:
    """Whether `pid` exits (or is a zombie, its parent gone) within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the parent-death signal is Linux's")


@linux_only
def test_a_child_started_like_tritonserver_dies_with_its_killed_parent():
    parent, child = _start_parent(STARTS_LIKE_TRITONSERVER)
    try:
        parent.kill()
        parent.wait()
        assert _gone(child, 5), "the child outlived its parent"
    finally:
        _kill(child)


@linux_only
def test_a_process_that_asked_gets_sigterm_when_its_parent_is_killed(tmp_path: Path):
    said = tmp_path / "said"
    parent, child = _start_parent(CHILD_ASKS_FOR_SIGTERM, str(said))
    try:
        deadline = time.monotonic() + 60
        while not said.is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        parent.kill()
        parent.wait()
        assert _gone(child, 5) and said.read_text() == "SIGTERM"
    finally:
        _kill(child)


def test_copy_repository_overrides_parameters(tmp_path: Path):
    dst = copy_repository(
        default_repository(), tmp_path / "repo",
        {"llm_none": {"max_batch_size": "2", "dtype": "float32", "ngram_capacity": "100"}},
    )
    params = read_parameters(dst / "llm_none" / "config.pbtxt")
    assert (params["max_batch_size"], params["dtype"], params["ngram_capacity"]) == ("2", "float32", "100")
    assert "max_batch_size" not in read_parameters(default_repository() / "llm_none" / "config.pbtxt")
    assert (dst / "llm_none" / "1" / "model.py").is_file()


def test_every_model_has_a_version_folder_in_the_checkout():
    """Triton refuses a model without a version; git drops empty folders (hence the .gitkeep files)."""
    repo = default_repository()
    for config in repo.glob("*/config.pbtxt"):
        assert (config.parent / "1").is_dir(), f"{config.parent.name}/1 is missing"
        assert any((config.parent / "1").iterdir()), f"{config.parent.name}/1 is empty (not tracked by git)"


def test_serve_sets_parameters_on_a_copy_of_the_repository(monkeypatch):
    import specserve.serving.server as server

    seen = {}

    def run(process, chosen, *_):  # stands in for starting tritonserver
        seen["params"] = read_parameters(process.repository / "llm_none" / "config.pbtxt")
        seen["models"], seen["log"] = process.models, process.log
        return 0

    monkeypatch.setattr(server, "_run_until_stopped", run)
    assert server.serve(None, ["none"], parameters={"max_batch_size": "3"}, log=Path("/tmp/x.log")) == 0
    assert seen["params"]["max_batch_size"] == "3" and seen["log"] == Path("/tmp/x.log")
    assert seen["models"] == models_for(["none"])
    assert "max_batch_size" not in read_parameters(default_repository() / "llm_none" / "config.pbtxt")


def test_serve_command_takes_parameters_as_key_value(capsys):
    from specserve.cli import main

    assert main(["serve", "--variants", "none", "--parameter", "max_batch_size"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
