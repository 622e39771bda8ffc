"""Run an `Engine` on its own thread and route each request's deltas to its callback.

Servers call `submit` from any thread; the loop thread steps the engine while there is work and
sleeps otherwise. The loop thread also *builds* the engine (`EngineLoop(factory)`), so all torch
work of a server runs on one thread: on a small CPU, torch ops issued from a second thread after
the first one had used OpenMP ran ~1.5x slower (two OpenMP teams oversubscribe the cores and
libgomp falls back to throttled spinning; measured decode 61-70 ms vs 40-48 ms). Before each step it polls the submitters' `is_cancelled` hooks and aborts those
requests. An exception inside a step fails the requests of that step (each gets an error output)
and the loop keeps serving. This module knows nothing about Triton.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from specserve.config import SamplingParams
from specserve.engine import Engine
from specserve.outputs import RequestOutput

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


@dataclass(frozen=True)
class _Subscriber:
    on_output: OutputCallback
    is_cancelled: Callable[[], bool] | None


class EngineLoop:
    def __init__(self, engine_factory: Callable[[], Engine]) -> None:
        """Start the loop thread, build the engine on it, and return once it is ready.

        engine_factory: builds (and may warm up) the engine; its exceptions are re-raised here.
        """
        self._subs: dict[str, _Subscriber] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, args=(engine_factory,), name="specserve-engine",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def _start(self, engine_factory: Callable[[], Engine]) -> None:
        try:
            self.engine = engine_factory()
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
            self._startup_error = e
            self._ready.set()
            return
        self._ready.set()
        self._run()

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_output: OutputCallback,
        is_cancelled: Callable[[], bool] | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; raises ValueError (naming the field) when it can never run."""
        with self._lock:
            rid = self.engine.add_request(prompt_ids, params, request_id)
            self._subs[rid] = _Subscriber(on_output, is_cancelled)
        self._wake.set()
        return rid

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._subs)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything, let the loop send the final outputs, then join the thread."""
        with self._lock:
            pending = list(self._subs)
        for rid in pending:
            self.engine.abort(rid)
        self._wake.set()
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            if not self.engine.has_work():
                if self._stop.is_set():
                    return
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            self._poll_cancelled()
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - one bad step must not stop the server
                log.error("engine step failed:\n%s", traceback.format_exc())
                outputs = self.engine.fail_running(f"engine error: {type(e).__name__}: {e}")
            self._deliver(outputs)

    def _poll_cancelled(self) -> None:
        with self._lock:
            subs = list(self._subs.items())
        for rid, sub in subs:
            if sub.is_cancelled is not None and sub.is_cancelled():
                self.engine.abort(rid)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                sub = self._subs.pop(out.request_id, None) if out.finished else self._subs.get(out.request_id)
            if sub is None:
                continue
            try:
                sub.on_output(out)
            except Exception:  # noqa: BLE001 - a broken client callback only affects its request
                log.error("output callback failed for %s:\n%s", out.request_id, traceback.format_exc())
                if not out.finished:
                    self.engine.abort(out.request_id)
