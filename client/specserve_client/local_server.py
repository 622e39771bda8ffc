"""A tritonserver for one variant, started here unless the caller already has one (benchmarks)."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path


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
    from specserve.serving.server import (
        TritonProcess,
        copy_repository,
        default_repository,
        free_port,
        models_for,
    )

    repository = Path(repository or default_repository())
    with tempfile.TemporaryDirectory(prefix="specserve-bench-") as tmp:
        if overrides:
            repository = copy_repository(repository, Path(tmp) / "repo", {f"llm_{variant}": dict(overrides)})
        ports = [free_port() for _ in range(3)]
        with TritonProcess(repository, models_for([variant]), *ports, log=log or Path(tmp) / "tritonserver.log") as server:
            yield server.grpc_url
