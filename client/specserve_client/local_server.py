"""A tritonserver for one variant, started here unless the caller already has one (benchmarks)."""

from __future__ import annotations

import argparse
import importlib
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType


def server_module() -> ModuleType:
    """`specserve.serving.server`, which starts a tritonserver here: part of the server package,
    not of the client, so a client-only install gets a clear error instead of a bare ImportError."""
    try:
        return importlib.import_module("specserve.serving.server")
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != "specserve":
            raise
        raise ModuleNotFoundError(
            "starting a tritonserver here needs the server package `specserve` (install the project root); "
            "where a command takes --url, point it at a running server instead",
            name=e.name,
        ) from e


def add_server_arguments(p: argparse.ArgumentParser, num_threads_help: str) -> None:
    """--url / --repository / --num-threads: the flags `server_for` and its callers share."""
    p.add_argument("--url", help="gRPC host:port of a running server (default: start one here)")
    p.add_argument("--repository", type=Path, help="model repository (default: the project's)")
    p.add_argument("--num-threads", type=int, help=num_threads_help)


@contextmanager
def server_for(
    variant: str,
    url: str | None = None,
    repository: Path | None = None,
    overrides: Mapping[str, str] | None = None,
    log: Path | None = None,
) -> Iterator[str]:
    """Yield the gRPC url: `url` as given, or a fresh server's (free ports, own process group).

    overrides: config.pbtxt parameters of llm_<variant> for this run (on a temporary copy).
    """
    if url is not None:
        yield url
        return
    server = server_module()
    repository = Path(repository or server.default_repository())
    with tempfile.TemporaryDirectory(prefix="specserve-bench-") as tmp:
        if overrides:
            repository = server.copy_repository(repository, Path(tmp) / "repo", {f"llm_{variant}": dict(overrides)})
        ports = [server.free_port() for _ in range(3)]
        log = log or Path(tmp) / "tritonserver.log"
        with server.TritonProcess(repository, server.models_for([variant]), *ports, log=log) as process:
            yield process.grpc_url
