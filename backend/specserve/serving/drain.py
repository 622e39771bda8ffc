"""Shutdown with streams open: the launcher drains the models before it signals tritonserver.

tritonserver, on SIGTERM, starts unloading a decoupled Python model at once (its requests do not
count as in flight once `execute` returned), and while it unloads, the responses of streams still
open stop flowing: tokens sent after the signal arrive seconds late or never. So the launcher
(`server.TritonProcess.stop`) first writes a *drain file* holding the time by which every stream
must have ended, and signals tritonserver only once every model has said it is drained (or that
time is past). Each `llm_<variant>` model watches for the file (`DrainWatch`): it refuses new
requests, lets the running ones finish until that time, ends the rest with UNAVAILABLE "server
shutting down" and a FINAL, then writes its *drained marker* beside the file. The file's path
reaches the models through the environment (`DRAIN_FILE_ENV`), which only the launcher sets: no
client can ask for a drain.

A tritonserver started without the launcher has no drain file: SIGTERM there cuts open streams,
as Triton does.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)

DRAIN_FILE_ENV = "SPECSERVE_DRAIN_FILE"
POLL_S = 0.1


def request_drain(path: Path, grace_s: float) -> None:
    """Tell the models watching `path` to end every stream within `grace_s` seconds from now."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{time.time() + grace_s:.3f}\n")
    tmp.replace(path)  # whole or absent: a model never reads half a deadline


def read_deadline(path: Path) -> float | None:
    """The wall-clock time written by `request_drain`, None while there is no (valid) file."""
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None


def drained_marker(path: Path, model_name: str) -> Path:
    """The file model `model_name` writes once drained (model names are path-safe in Triton)."""
    return path.with_name(f"{path.name}.{model_name}.drained")


def wait_drained(path: Path, model_names: Iterable[str], timeout_s: float,
                 keep_waiting: Callable[[], bool] = lambda: True) -> bool:
    """Wait up to `timeout_s` for every model's drained marker; False if one is still missing."""
    markers = [drained_marker(path, name) for name in model_names]
    deadline = time.monotonic() + timeout_s
    while not all(m.exists() for m in markers):
        if time.monotonic() >= deadline or not keep_waiting():
            return False
        time.sleep(POLL_S / 2)
    return True


class DrainWatch:
    """A thread that, once the drain file appears, calls `drain(seconds_left)` (at most once) and
    then writes the model's drained marker; it ends when `closing` is set. `path` None (no launcher
    asked for it): no thread at all."""

    def __init__(self, path: str | None, model_name: str, drain: Callable[[float], None],
                 closing: threading.Event) -> None:
        self.path = Path(path) if path else None
        self.model_name = model_name
        self._drain, self._closing = drain, closing
        self._thread: threading.Thread | None = None
        if self.path is not None:
            self._thread = threading.Thread(target=self._run, name="specserve-drain", daemon=True)
            self._thread.start()

    @classmethod
    def from_environment(cls, model_name: str, drain: Callable[[float], None],
                         closing: threading.Event) -> DrainWatch:
        return cls(os.environ.get(DRAIN_FILE_ENV), model_name, drain, closing)

    def _run(self) -> None:
        assert self.path is not None
        while not self._closing.wait(POLL_S):
            deadline = read_deadline(self.path)
            if deadline is None:
                continue
            try:
                self._drain(max(0.0, deadline - time.time()))
            except Exception:  # noqa: BLE001 - the server's own shutdown still ends what is left
                log.exception("draining failed")
            try:
                drained_marker(self.path, self.model_name).touch()
            except OSError:  # the launcher is gone and took its directory: nobody waits
                pass
            return

    def join(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
