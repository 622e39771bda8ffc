"""EngineLoop with a fake engine: built on its own thread, startup errors re-raised, deltas routed,
a failing step ends only that step's requests."""

from __future__ import annotations

import threading

import pytest

from specserve.config import SamplingParams
from specserve.loop import EngineLoop
from specserve.outputs import FINISH_ERROR, FINISH_LENGTH, RequestOutput


class FakeEngine:
    def __init__(self, fail_on: str | None = None) -> None:
        self.built_on = threading.current_thread().name
        self.pending: list[str] = []
        self.fail_on = fail_on
        self._lock = threading.Lock()

    def add_request(self, prompt_ids, params, request_id=None) -> str:
        with self._lock:
            rid = request_id or f"r{len(self.pending)}-{prompt_ids[0]}"
            self.pending.append(rid)
        return rid

    def abort(self, request_id: str) -> None:
        pass

    def has_work(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[RequestOutput]:
        with self._lock:
            batch, self.pending = self.pending, []
        if self.fail_on in batch:
            self.running = batch
            raise RuntimeError("boom")
        return [RequestOutput(r, [1], "x", finished=True, finish_reason=FINISH_LENGTH) for r in batch]

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


def test_a_failing_step_errors_its_requests_and_the_loop_keeps_serving():
    loop = EngineLoop(lambda: FakeEngine(fail_on="r0-7"))
    try:
        out = _run(loop, [7])
        assert out.finish_reason == FINISH_ERROR and "boom" in (out.error or "")
        assert _run(loop, [8]).finish_reason == FINISH_LENGTH
    finally:
        loop.shutdown()
