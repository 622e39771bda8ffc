"""EngineLoop with a fake engine: built on its own thread, startup errors re-raised, deltas routed,
a failing step ends only that step's requests, an upgraded engine takes new requests (and its drafter
what the old one's learned) while the one it replaced finishes its own, also under constant load."""

from __future__ import annotations

import gc
import itertools
import threading
import time
import weakref

import pytest

from specserve.config import SamplingParams
from specserve.engine import loop as loop_module
from specserve.engine.loop import EngineLoop, EngineStopped
from specserve.engine.outputs import FINISH_ERROR, FINISH_LENGTH, EngineLoad, RequestOutput


class FakeDrafter:
    """Records the drafter it took over from (`Drafter.inherit`)."""

    inherited_from: FakeDrafter | None = None

    def inherit(self, previous: FakeDrafter) -> None:
        self.inherited_from = previous


class FakeEngine:
    """Ends each request in one step with its prompt's first token as output; names a request it is
    given no id for from a count of its own, as `Engine` does."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.built_on = threading.current_thread().name
        self.drafter = FakeDrafter()
        self.pending: list[str] = []
        self.prompts: dict[str, int] = {}
        self.fail_on = fail_on  # a step holding this prompt raises
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def grammar_match(self, params) -> None:
        return None  # no structured outputs here: the loop compiles nothing

    def add_request(self, prompt_ids, params, request_id=None, grammar=None) -> str:
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            self.pending.append(rid)
            self.prompts[rid] = prompt_ids[0]
        return rid

    def abort(self, request_id: str) -> None:
        pass

    def has_work(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[RequestOutput]:
        with self._lock:
            batch, self.pending = self.pending, []
        if any(self.prompts[r] == self.fail_on for r in batch):
            self.running = batch
            raise RuntimeError("boom")
        return [RequestOutput(r, [self.prompts[r]], "x", finished=True, finish_reason=FINISH_LENGTH) for r in batch]

    def fail_running(self, error: str) -> list[RequestOutput]:
        outs = [RequestOutput(r, [], "", finished=True, finish_reason=FINISH_ERROR, error=error) for r in self.running]
        self.running = []
        return outs


def _run(loop: EngineLoop, prompt: list[int]) -> RequestOutput:
    done, box = threading.Event(), []
    loop.submit(prompt, SamplingParams(max_tokens=1), lambda out: (box.append(out), done.set()))
    assert done.wait(5)
    return box[-1]


def test_engine_is_built_on_the_loop_thread_and_serves():
    loop = EngineLoop(FakeEngine)
    try:
        assert loop.engine.built_on == "specserve-engine"
        assert _run(loop, [3]).finish_reason == FINISH_LENGTH
    finally:
        loop.shutdown()


def test_startup_error_is_raised_to_the_caller():
    def broken() -> FakeEngine:
        raise FileNotFoundError("model_dir: nope")

    with pytest.raises(FileNotFoundError, match="model_dir"):
        EngineLoop(broken)


def test_an_upgrade_is_built_when_ready_and_takes_new_requests():
    state: list[bool | None] = [None]
    building, release = threading.Event(), threading.Event()

    def upgraded() -> FakeEngine:
        building.set()
        assert release.wait(5)  # requests arrive while the new engine builds
        return FakeEngine()

    loop = EngineLoop(FakeEngine)
    first = loop.engine
    try:
        loop.upgrade_when_ready(lambda: state[0], upgraded)
        assert _run(loop, [1]).finish_reason == FINISH_LENGTH and loop.engine is first  # not ready yet
        state[0] = True
        assert building.wait(5)
        done = threading.Event()
        loop.submit([2], SamplingParams(max_tokens=1), lambda out: done.set())
        release.set()
        assert done.wait(5) and loop.upgraded.wait(5)  # the old engine served it, the new one takes over
        assert loop.engine is not first and first.pending == []
        assert loop.engine.drafter.inherited_from is first.drafter  # what it learned across requests
        assert _run(loop, [3]).finish_reason == FINISH_LENGTH and loop.engine.built_on == "specserve-engine"
    finally:
        loop.shutdown()


def test_the_replaced_engine_is_freed_when_it_is_retired():
    """An engine's parts refer to each other: the replaced one goes with its cycles at its retirement, not
    at the collector's next full pass (its KV cache and weights resident beside the new engine's)."""

    class CyclicEngine(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.parts = {"engine": self}  # as an engine's runner, drafter and callbacks refer back to it

    collecting = gc.isenabled()
    gc.disable()  # only an explicit collection frees a cycle now
    loop = EngineLoop(CyclicEngine)
    try:
        first = weakref.ref(loop.engine)
        assert _run(loop, [1]).finish_reason == FINISH_LENGTH  # the loop has stepped it
        loop.upgrade_when_ready(lambda: True, CyclicEngine)
        assert loop.upgraded.wait(5)
        deadline = time.monotonic() + 5
        while first() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first() is None
    finally:
        loop.shutdown()
        if collecting:
            gc.enable()


class SlowEngine(FakeEngine):
    """Ends one request a step, `steps_per_request` steps after it arrived; counts prompts as computed."""

    def __init__(self, steps_per_request: int = 3) -> None:
        super().__init__()
        self.steps_per_request, self.ages, self.computed = steps_per_request, {}, 0

    def add_request(self, prompt_ids, params, request_id=None, grammar=None) -> str:
        rid = super().add_request(prompt_ids, params, request_id)
        self.computed += len(prompt_ids)
        return rid

    def step(self) -> list[RequestOutput]:
        time.sleep(0.01)
        with self._lock:
            for rid in self.pending:
                self.ages[rid] = self.ages.get(rid, 0) + 1
            done = [r for r in self.pending if self.ages[r] >= self.steps_per_request]
            self.pending = [r for r in self.pending if r not in done]
        return [RequestOutput(r, [self.prompts[r]], "x", finished=True, finish_reason=FINISH_LENGTH) for r in done]

    def load(self) -> EngineLoad:
        return EngineLoad(0, len(self.pending), len(self.pending), prompt_tokens_computed=self.computed)


def test_an_upgrade_under_constant_load_takes_over_while_the_old_engine_finishes_its_requests(monkeypatch):
    """Never idle: the upgrade is built between steps once it waited UPGRADE_WAIT_S; every request
    ends, the old engine's in it, and the prompt counters never fall."""
    monkeypatch.setattr(loop_module, "UPGRADE_WAIT_S", 0.2)
    loads: list[EngineLoad] = []
    loop = EngineLoop(SlowEngine, on_step=loads.append)
    first = loop.engine
    ended: list[str] = []
    lock = threading.Lock()

    def submit(i: int) -> None:
        loop.submit([i, i], SamplingParams(max_tokens=1),
                    lambda out: out.finished and (lock.acquire(), ended.append(out.request_id), lock.release()))

    try:
        for i in range(4):
            submit(i)
        loop.upgrade_when_ready(lambda: True, SlowEngine)
        deadline = time.monotonic() + 5
        i = 4
        while not loop.upgraded.is_set() and time.monotonic() < deadline:  # a request every step: never idle
            submit(i)
            i += 1
            time.sleep(0.01)
        assert loop.upgraded.is_set() and loop.engine is not first
        held_by_old = list(first.pending)
        assert held_by_old, "the old engine still held requests when the new one took over"
        for _ in range(3):
            submit(i)
            i += 1
        deadline = time.monotonic() + 5
        while len(ended) < i and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(ended) == i and len(set(ended)) == i  # every request ended, once
        assert first.pending == [] and loop._replaced is None  # the old engine finished and was dropped
        computed = [load.prompt_tokens_computed for load in loads]
        assert computed == sorted(computed) and computed[-1] == 2 * i  # both engines' prompts, never falling
    finally:
        loop.shutdown()


def test_requests_before_and_after_an_upgrade_never_share_an_id(monkeypatch):
    """A long request the old engine holds and the new engine's first requests: each engine would
    name its first request `req-0`; every callback gets its own request's outputs and one final."""
    monkeypatch.setattr(loop_module, "UPGRADE_WAIT_S", 0.0)
    loop = EngineLoop(lambda: SlowEngine(steps_per_request=40))
    first = loop.engine
    received: dict[int, list[RequestOutput]] = {}
    done = threading.Semaphore(0)

    def submit(prompt: int) -> str:
        def on_output(out: RequestOutput, prompt: int = prompt) -> None:
            received.setdefault(prompt, []).append(out)
            if out.finished:
                done.release()

        return loop.submit([prompt], SamplingParams(max_tokens=1), on_output)

    try:
        ids = [submit(1000)]
        loop.upgrade_when_ready(lambda: True, FakeEngine)
        assert loop.upgraded.wait(5) and first.pending, "the old engine still holds the long request"
        ids += [submit(i) for i in range(20)]
        for _ in ids:
            assert done.acquire(timeout=5)
        assert len(set(ids)) == len(ids)
        assert sorted(received) == [*range(20), 1000]
        for prompt, outs in received.items():
            assert [t for out in outs for t in out.token_ids] == [prompt]
            assert [out.finished for out in outs] == [True]
    finally:
        loop.shutdown()


def test_an_open_request_id_is_refused_not_overwritten():
    loop = EngineLoop(lambda: SlowEngine(steps_per_request=50))
    try:
        got: list[RequestOutput] = []
        loop.submit([5], SamplingParams(max_tokens=1), got.append, request_id="mine")
        with pytest.raises(ValueError, match="request_id"):
            loop.submit([6], SamplingParams(max_tokens=1), got.append, request_id="mine")
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [out.token_ids for out in got] == [[5]]
    finally:
        loop.shutdown()


def test_an_upgrade_that_is_never_ready_or_fails_keeps_the_engine():
    for ready, factory in ((lambda: False, FakeEngine), (lambda: True, lambda: 1 / 0)):
        loop = EngineLoop(FakeEngine)
        first = loop.engine
        try:
            loop.upgrade_when_ready(ready, factory)
            assert _run(loop, [1]).finish_reason == FINISH_LENGTH
            assert not loop.upgraded.wait(0.3) and loop.engine is first
            assert _run(loop, [2]).finish_reason == FINISH_LENGTH
        finally:
            loop.shutdown()


def test_a_failing_step_errors_its_requests_and_the_loop_keeps_serving():
    loop = EngineLoop(lambda: FakeEngine(fail_on=7))
    try:
        out = _run(loop, [7])
        assert out.finish_reason == FINISH_ERROR and "boom" in (out.error or "")
        assert _run(loop, [8]).finish_reason == FINISH_LENGTH
    finally:
        loop.shutdown()


class AlwaysFailing(FakeEngine):
    """Every step raises and leaves its requests open (as a failure outside `fail_running`'s reach would)."""

    def step(self) -> list[RequestOutput]:
        raise RuntimeError("device lost")

    def fail_running(self, error: str) -> list[RequestOutput]:
        return []


def test_failed_steps_in_a_row_stop_the_loop_end_every_request_and_refuse_new_ones():
    stopped: list[str] = []
    loop = EngineLoop(AlwaysFailing, on_stopped=stopped.append, max_failed_steps=3)
    try:
        out = _run(loop, [7])
        assert out.finished and out.finish_reason == FINISH_ERROR
        assert "3 engine steps failed in a row" in (out.error or "") and "device lost" in out.error
        assert len(stopped) == 1 and stopped[0] == loop.stopped_reason
        with pytest.raises(EngineStopped, match="device lost"):
            loop.submit([8], SamplingParams(max_tokens=1), lambda out: None)
    finally:
        loop.shutdown()


def test_an_exception_outside_a_step_ends_every_request():
    class BrokenScheduler(FakeEngine):
        def has_work(self) -> bool:
            if self.pending:
                raise RuntimeError("scheduler bug")
            return False

    stopped: list[str] = []
    loop = EngineLoop(BrokenScheduler, on_stopped=stopped.append)
    try:
        out = _run(loop, [7])
        assert out.finish_reason == FINISH_ERROR and "scheduler bug" in (out.error or "")
        assert stopped and not loop._thread.is_alive()
    finally:
        loop.shutdown()


def test_load_is_reported_after_steps_and_back_to_zero_when_idle():
    class WithLoad(FakeEngine):
        def load(self) -> EngineLoad:
            return EngineLoad(waiting=len(self.pending), running=0, kv_slots_used=0)

    loads: list[EngineLoad] = []
    loop = EngineLoop(WithLoad, on_step=loads.append)
    try:
        _run(loop, [7])
        for _ in range(100):
            if loads and loads[-1] == EngineLoad(0, 0, 0):
                break
            threading.Event().wait(0.01)
        assert loads and loads[-1] == EngineLoad(0, 0, 0)
    finally:
        loop.shutdown()


# ---- admission control, timeouts and the abort path on a real (tiny) engine ----------------------


def _tiny_engine(tiny_target_dir, **config):
    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine

    config = {"max_batch_size": 2, "max_seq_len": 128, **config}
    return Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", cpu_compile=False,
                               **config))


def _slots(load: EngineLoad) -> tuple[int, int, int]:
    """The load's request counts (its prompt-token counters aside)."""
    return load.waiting, load.running, load.kv_slots_used


def test_a_full_queue_refuses_with_queue_full(tiny_target_dir):
    from specserve.engine.engine import QueueFull

    eng = _tiny_engine(tiny_target_dir, max_queue_size=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    eng.add_request([5, 6, 7], params)
    eng.add_request([5, 6, 8], params)
    with pytest.raises(QueueFull, match="max_queue_size: 2 requests"):
        eng.add_request([5, 6, 9], params)
    eng.step()  # both admitted into the two slots: the queue is empty again
    assert _slots(eng.load()) == (0, 2, 2)  # waiting, running, slots used
    eng.add_request([5, 6, 9], params)
    assert eng.load().waiting == 1


def test_requests_past_their_timeout_end_with_timeout(tiny_target_dir):
    import time

    from specserve.engine.outputs import FINISH_TIMEOUT

    eng = _tiny_engine(tiny_target_dir, max_batch_size=1, request_timeout_s=0.2)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    running, waiting = eng.add_request([5, 6, 7], params), eng.add_request([5, 6, 8], params)
    eng.step()
    time.sleep(0.3)
    outs = {o.request_id: o for o in eng.step()}
    assert outs[running].finish_reason == FINISH_TIMEOUT and outs[waiting].finish_reason == FINISH_TIMEOUT
    assert "request_timeout_s" in (outs[waiting].error or "")
    assert _slots(eng.load()) == (0, 0, 0) and not eng.has_work()


def test_a_failing_step_still_sends_the_aborts_it_had_made(tiny_target_dir):
    from specserve.engine.outputs import FINISH_ABORT

    eng = _tiny_engine(tiny_target_dir)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    a, b = eng.add_request([5, 6, 7], params), eng.add_request([5, 6, 8], params)
    eng.step()
    eng.abort(a)

    def broken(reqs):  # noqa: ANN001, ANN202
        raise RuntimeError("verify failed")

    eng._verify_step = broken
    with pytest.raises(RuntimeError):
        eng.step()
    outs = {o.request_id: o for o in eng.fail_running("engine error")}
    assert outs[a].finish_reason == FINISH_ABORT and outs[b].finish_reason == FINISH_ERROR
    assert _slots(eng.load()) == (0, 0, 0)


def test_drain_refuses_new_requests_lets_short_ones_finish_and_aborts_the_rest(tiny_target_dir):
    from specserve.engine.outputs import FINISH_ABORT

    loop = EngineLoop(lambda: _tiny_engine(tiny_target_dir, max_seq_len=4096))
    try:
        finals: dict[str, RequestOutput] = {}
        done = threading.Event()

        def collect(out: RequestOutput) -> None:
            if out.finished:
                finals[out.request_id] = out
                if len(finals) == 2:
                    done.set()

        short = loop.submit([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), collect)
        endless = loop.submit([5, 6, 8], SamplingParams(max_tokens=4000, ignore_eos=True), collect)
        started = time.monotonic()
        assert loop.drain(0.5) == 1
        assert 0.5 <= time.monotonic() - started < 5
        with pytest.raises(EngineStopped, match="shutting down"):
            loop.submit([5, 6, 9], SamplingParams(max_tokens=1), collect)
        assert done.wait(5)
        assert finals[short].finish_reason == FINISH_LENGTH
        assert finals[endless].finish_reason == FINISH_ABORT
    finally:
        loop.shutdown()


def test_drain_returns_at_once_when_nothing_is_open():
    loop = EngineLoop(FakeEngine)
    try:
        started = time.monotonic()
        assert loop.drain(30.0) == 0
        assert time.monotonic() - started < 1
    finally:
        loop.shutdown()
