"""The soak's request mix (`specserve_client.soak`): only the kinds asked for are drawn, each is
checked against its expected outcome. The server and gRPC client are stand-ins here; `make soak`
runs the real ones."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from specserve_client import soak


class _Client:
    def __init__(self, url: str) -> None:
        self.url = url

    def close(self) -> None:
        pass


def _run_worker(monkeypatch, kinds, answer):
    calls = []

    def one_request(client, model, values, request_id, cancel_after, trtllm_format, text=None):  # noqa: ANN001, ANN202
        calls.append((model, cancel_after, trtllm_format, values))
        if text is not None:
            text.append(f"answer {len(calls)}")
        return answer(model, cancel_after)

    monkeypatch.setattr(soak.grpcclient, "InferenceServerClient", _Client)
    monkeypatch.setattr(soak, "one_request", one_request)
    outcomes, failures = Counter(), []
    soak.worker("url", "none", time.monotonic() + 0.2, 0, outcomes, failures, threading.Lock(), kinds=kinds)
    return calls, outcomes, failures


def test_only_the_kinds_asked_for_are_drawn(monkeypatch):
    calls, outcomes, failures = _run_worker(monkeypatch, ("normal",), lambda model, cancel_after: "ok")
    assert calls and not failures
    assert set(outcomes) == {"normal:ok"}
    assert all(model == "llm_none" and cancel_after is None and not trtllm for model, cancel_after, trtllm, _ in calls)


def test_every_kind_is_drawn_and_a_wrong_outcome_is_a_failure(monkeypatch):
    calls, outcomes, failures = _run_worker(monkeypatch, tuple(soak.KIND_WEIGHTS), lambda model, cancel_after: "ok")
    assert {key.split(":")[0] for key in outcomes} == {"normal", "ensemble", "cancel", "bad", "turn"}
    assert any(model == "ensemble_none" and trtllm for model, _, trtllm, _ in calls)
    # a cancelled stream or a bad request answered "ok" did not do what it must
    assert failures and all(f.startswith(("cancel ", "bad ")) for f in failures)
    assert outcomes["cancel:ok"] + outcomes["bad:ok"] == len(failures)


def test_a_turn_continues_the_conversation_with_its_answers(monkeypatch):
    calls, outcomes, failures = _run_worker(monkeypatch, ("turn",), lambda model, cancel_after: "ok")
    prompts = [values["text_input"] for *_, values in calls]
    assert len(prompts) > soak.TURNS and not failures
    for i in range(1, soak.TURNS):  # each turn's prompt starts with the one before it and its answer
        assert prompts[i].startswith(prompts[i - 1] + f"answer {i}")
    assert not prompts[soak.TURNS].startswith(prompts[soak.TURNS - 1])  # then a new conversation
    assert all(values["apply_chat_template"] is False for *_, values in calls)


def test_unknown_kinds_are_refused():
    with pytest.raises(SystemExit):
        soak.main(["--kinds", "normal,nonsense"])


class _Final:
    def __init__(self, final: bool) -> None:
        self.bool_param = final


class _Response:
    def __init__(self, request_id: str, final: bool) -> None:
        self.id, self.outputs = request_id, [] if final else ["output_ids"]
        self.parameters = {"triton_final_response": _Final(final)}


class _Result:
    def __init__(self, request_id: str, final: bool) -> None:
        self.response = _Response(request_id, final)

    def get_response(self) -> _Response:
        return self.response

    def as_numpy(self, name: str):  # noqa: ANN201
        import numpy as np

        return np.zeros(1, dtype=np.int32)


class _StreamingClient:
    """Answers a stream with `tokens` one-token responses and a FINAL; records how it was stopped."""

    def __init__(self, tokens: int) -> None:
        self.tokens, self.stops = tokens, []

    def start_stream(self, callback) -> None:  # noqa: ANN001
        self.callback = callback

    def async_stream_infer(self, model, inputs, request_id, **kwargs) -> None:  # noqa: ANN001, ANN003
        for _ in range(self.tokens):
            self.callback(_Result(request_id, False), None)
        self.callback(_Result(request_id, True), None)

    def stop_stream(self, cancel_requests: bool = False) -> None:
        self.stops.append(cancel_requests)


def test_a_finished_stream_is_closed_and_an_abandoned_one_cancelled():
    # cancelling a stream after its FINAL is not what a client that is done does (and the Triton
    # shipped keeps such streams' state): only a stream left before its FINAL is cancelled
    values = {"text_input": "Hi", "max_tokens": 4}
    done = _StreamingClient(tokens=3)
    assert soak.one_request(done, "llm_none", values, "r1", cancel_after=None) == "ok"
    assert done.stops == [False]
    left = _StreamingClient(tokens=3)
    assert soak.one_request(left, "llm_none", values, "r2", cancel_after=1) == "cancelled"
    assert left.stops and all(left.stops)


def test_memory_counts_the_server_and_its_stubs_not_a_compile_process(monkeypatch):
    processes = {"tritonserver (10)": 10, "stub llm_eagle3 (11)": 11, "python3 (12)": 12}
    monkeypatch.setattr(soak, "server_processes", lambda root: processes)
    monkeypatch.setattr(soak, "resident_mb", lambda pid: {"rss": float(pid * 10), "anon": 1.0})
    sample = soak.server_memory(10)
    assert sample["rss_mb"] == 210.0 and sample["by_process"]["python3 (12)"] == 120.0


def test_growth_counts_from_the_first_sample_after_start_up():
    memory = [{"s": s, "rss_mb": mb} for s, mb in ((0, 100.0), (60, 150.0), (90, 900.0), (150, 910.0), (200, 905.0))]
    assert soak.growth_after(memory, 60) == 760.0  # the switch to compiled programs included
    assert soak.growth_after(memory, 150) == 0.0 and soak.growth_after(memory, 90) == 10.0
    assert soak.growth_after(memory, 300) == 0.0
