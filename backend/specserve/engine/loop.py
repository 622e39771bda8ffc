"""Run an `Engine` on its own thread and route each request's deltas to its callback.

Servers call `submit` from any thread; the loop thread steps the engine while there is work and
sleeps otherwise. The loop thread also *builds* the engine (`EngineLoop(factory)`), so all torch
work of a server runs on one thread: on a small CPU, torch ops issued from a second thread after
the first one had used OpenMP ran much slower (two OpenMP teams oversubscribe the cores).

Health. An exception inside a step fails the requests of that step (each gets an error output,
and the aborts and timeouts the step had already ended still go out) and the loop keeps serving.
`max_failed_steps` failures in a row, or an exception outside a step, stop the loop: every open
request gets a final error output, `submit` refuses with `EngineStopped`, and `on_stopped` tells
the server (which marks the model not ready).

Upgrade. `upgrade_when_ready(ready, factory)` replaces the engine by a better-built one (a server
starts on an eager engine while its compiled programs build elsewhere). Once `ready()` says so,
the loop thread builds `factory()`'s engine at the next idle moment, or between two steps when no
idle moment came within `UPGRADE_WAIT_S` (a model under constant load; its streams pause for the
build). New requests go to the new engine at once; the old one finishes the requests it holds,
stepped beside the new one, and is dropped when it has none left. The new engine's drafter takes
over what the old one learned across requests (`Drafter.inherit`: the suffix drafter's store).

Request ids. The loop names every request it submits (`req-<n>`, one count for the loop, whichever
engine takes the request), so the engines an upgrade puts side by side never hold the same id; a
caller's own id that is already open is refused, never overwritten.

Stopping. `drain(timeout_s)` refuses new requests and gives the open ones that long to finish
before it aborts them; `shutdown` aborts at once and joins the loop thread.

Cancellation is the caller's: `abort(request_id)` from any thread ends the request within a
step. `on_step` receives the engine's load whenever it changes (the serving gauges); a caller
whose gauges are slow to set hands the value to a thread of its own. This module knows nothing
about Triton.
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import astuple
from typing import TYPE_CHECKING

from specserve.config import SamplingParams
from specserve.engine.outputs import FINISH_ERROR, EngineLoad, RequestOutput

if TYPE_CHECKING:  # importing the engine imports torch: this module is imported before a server needs it
    from specserve.engine.engine import Engine

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]

UPGRADE_WAIT_S = 2.0  # a ready upgrade waits this long for an idle moment, then is built between steps
UPGRADE_POLL_S = 0.5  # how often a busy loop asks whether the upgrade is ready
DRAIN_POLL_S = 0.05  # how often `drain` looks whether the open requests have ended


class EngineStopped(RuntimeError):
    """`submit` after the loop stopped (the engine failed for good)."""


class EngineLoop:
    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        on_step: Callable[[EngineLoad], None] | None = None,
        on_stopped: Callable[[str], None] | None = None,
        max_failed_steps: int = 3,
    ) -> None:
        """Start the loop thread, build the engine on it, and return once it is ready.

        engine_factory: builds (and may warm up) the engine; its exceptions are re-raised here.
        on_step: called on the loop thread with the engine's load whenever it changes (after a step, when idle).
        on_stopped: called once, on the loop thread, with the reason, if the loop stops by failure.
        """
        self._subs: dict[str, OutputCallback] = {}
        self._ids = itertools.count()  # request ids, one space for every engine this loop runs
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._on_step, self._on_stopped = on_step, on_stopped
        self.max_failed_steps = max_failed_steps
        self.stopped_reason: str | None = None  # set when the loop stopped by failure
        self._last_load: EngineLoad | None = None
        self._upgrade: tuple[Callable[[], bool | None], Callable[[], Engine]] | None = None
        self._ready_since: float | None = None  # when `ready()` first said True while the engine was busy
        self._next_poll = 0.0
        self._failures = 0  # engine steps failed in a row
        self._replaced: Engine | None = None  # the engine an upgrade replaced, finishing its requests
        self._retired = EngineLoad(0, 0, 0)  # the prompt counters of engines dropped after an upgrade
        self.upgraded = threading.Event()  # set once new requests go to the upgraded engine
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
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - a dead loop must not leave clients hanging
            log.error("engine loop stopped:\n%s", traceback.format_exc())
            self._fail_all(f"engine stopped: {type(e).__name__}: {e}")

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_output: OutputCallback,
        request_id: str | None = None,
    ) -> str:
        """Queue a request under `request_id` (default: the loop's next `req-<n>`); raises ValueError
        (naming the field) when it can never run or its id is open already, QueueFull when the
        engine's queue is full, EngineStopped after the loop stopped."""
        grammar = self.engine.grammar_match(params)  # compiled on the caller's thread, outside the lock
        with self._lock:
            if self.stopped_reason is not None:
                raise EngineStopped(self.stopped_reason)
            if self._stop.is_set():
                raise EngineStopped("the server is shutting down")
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._subs:
                raise ValueError(f"request_id: {rid!r} is already in use by an unfinished request")
            self.engine.add_request(prompt_ids, params, rid, grammar)
            self._subs[rid] = on_output
        self._wake.set()
        return rid

    def abort(self, request_id: str) -> None:
        for engine in self._engines():  # the one holding the request (an engine ignores ids it does not hold)
            engine.abort(request_id)
        self._wake.set()

    def upgrade_when_ready(self, ready: Callable[[], bool | None], factory: Callable[[], Engine]) -> None:
        """Replace the engine by `factory()`'s once `ready()` is True (polled on the loop thread;
        False: never, None: not yet), preferably at an idle moment (see the module's docstring)."""
        self._upgrade = (ready, factory)
        self._ready_since, self._next_poll = None, 0.0
        self._wake.set()

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._subs)

    def drain(self, timeout_s: float) -> int:
        """Refuse new requests, give the open ones up to `timeout_s` to finish, then abort the rest
        (their final outputs go out as the loop steps); returns how many were aborted. The loop
        thread ends once idle; `shutdown` still joins it."""
        with self._lock:
            self._stop.set()
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        while self.num_active and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL_S)
        with self._lock:
            pending = list(self._subs)
        for rid in pending:
            self.abort(rid)
        return len(pending)

    def shutdown(self) -> None:
        """Refuse new requests, abort the open ones, let the loop send their final outputs, then join
        its thread (after an upgrade build it had begun: none begins once this is called)."""
        self.drain(0.0)
        self._thread.join()

    def _engines(self) -> list[Engine]:
        """The engine taking new requests, and the one an upgrade replaced while it still runs."""
        with self._lock:
            return [self.engine] if self._replaced is None else [self.engine, self._replaced]

    def _run(self) -> None:
        while True:  # no engine in a local here: a retired engine must have no reference left
            if not any(e.has_work() for e in self._engines()):
                self._retire_replaced()
                self._report_load()  # back to idle: the gauges read zero
                if self._stop.is_set():
                    return
                if self._build_upgrade(idle=True):
                    continue
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            if self._build_upgrade(idle=False):
                continue
            self._step_engines()
            self._retire_replaced()

    def _step_engines(self) -> None:
        """One step of each engine holding work, its outputs delivered."""
        for engine in [e for e in self._engines() if e.has_work()]:
            try:
                outputs = engine.step()
                self._failures = 0
            except Exception as e:  # noqa: BLE001 - one bad step must not stop the server
                self._failures += 1
                log.error("engine step failed (%d in a row):\n%s", self._failures, traceback.format_exc())
                outputs = engine.fail_running(f"engine error: {type(e).__name__}: {e}")
                if self._failures >= self.max_failed_steps:
                    self._deliver(outputs)
                    raise RuntimeError(
                        f"{self._failures} engine steps failed in a row; last: {type(e).__name__}: {e}"
                    ) from e
            # the load first: a client that has a response then reads gauges that count its request
            self._report_load()
            self._deliver(outputs)

    def _build_upgrade(self, idle: bool) -> bool:
        """Build the upgraded engine if it is due (see the module's docstring) and send new requests
        to it; True if it was built (or found never to be)."""
        if self._upgrade is None or self._replaced is not None or self._stop.is_set():
            return False
        now = time.monotonic()
        if not idle and now < self._next_poll:
            return False
        self._next_poll = now + UPGRADE_POLL_S
        ready, factory = self._upgrade
        state = ready()
        if state is None:
            return False
        if state and not idle:
            self._ready_since = self._ready_since or now
            if now - self._ready_since < UPGRADE_WAIT_S:
                return False
        self._upgrade = None
        if not state:
            return True
        try:
            engine = factory()
            engine.drafter.inherit(self.engine.drafter)  # what the old one learned across requests
        except Exception:  # noqa: BLE001 - the running engine keeps serving
            log.error("engine upgrade failed; the running engine keeps serving:\n%s", traceback.format_exc())
            return True
        with self._lock:  # requests submitted from now on enter the new engine
            self.engine, self._replaced = engine, self.engine
        self.upgraded.set()
        log.info("engine upgraded: new requests go to the new engine%s",
                 "" if idle else "; the old one finishes the requests it holds")
        self._retire_replaced()
        return True

    def _retire_replaced(self) -> None:
        """Drop the replaced engine once it holds no request (its prompt counters live on in the load),
        and collect it at once: an engine's parts refer to each other, so without a collection its KV
        cache and weights stayed resident beside the new engine's until the collector's next full pass
        (seconds to minutes in a served process)."""
        old = self._replaced
        if old is None or old.has_work():
            return
        if self._on_step is not None:
            load = old.load()
            self._retired = EngineLoad(
                0, 0, 0, prompt_tokens_reused=self._retired.prompt_tokens_reused + load.prompt_tokens_reused,
                prompt_tokens_computed=self._retired.prompt_tokens_computed + load.prompt_tokens_computed,
            )
        with self._lock:
            self._replaced = None
        del old
        gc.collect()

    def _report_load(self) -> None:
        """`on_step` with the engine's load, only when it changed (the gauges are an IPC each)."""
        if self._on_step is None:
            return
        loads = [self._retired, *(e.load() for e in self._engines())]
        load = EngineLoad(*(sum(values) for values in zip(*map(astuple, loads))))
        if load != self._last_load:
            self._last_load = load
            self._on_step(load)

    def _fail_all(self, reason: str) -> None:
        """The loop is gone: end every open request with an error output and refuse new ones."""
        with self._lock:
            self.stopped_reason = reason
            subs, self._subs = self._subs, {}
        for rid, on_output in subs.items():
            out = RequestOutput(rid, [], "", finished=True, finish_reason=FINISH_ERROR, error=reason)
            try:
                on_output(out)
            except Exception:  # noqa: BLE001 - keep ending the others
                log.error("output callback failed for %s:\n%s", rid, traceback.format_exc())
        if self._on_stopped is not None:
            self._on_stopped(reason)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                on_output = self._subs.pop(out.request_id, None) if out.finished else self._subs.get(out.request_id)
            if on_output is None:
                continue
            try:
                on_output(out)
            except Exception:  # noqa: BLE001 - a broken client callback only affects its request
                log.error("output callback failed for %s:\n%s", out.request_id, traceback.format_exc())
                if not out.finished:
                    self.abort(out.request_id)
