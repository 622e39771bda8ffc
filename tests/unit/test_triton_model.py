"""The decoupled model's response logic with a fake `triton_python_backend_utils`: exactly one
FINAL on every path (stream, stream=false, abort, engine error, shutdown, bad input)."""

from __future__ import annotations

import json
import sys
import threading
import time
import types
from typing import Any

import numpy as np
import pytest
from triton_fakes import FakeError, FakeFamily, FakeResponse, FakeTensor

from specserve.engine.engine import QueueFull
from specserve.engine.loop import EngineStopped

FINAL = 1


@pytest.fixture(scope="module")
def triton_model():
    fake = types.ModuleType("triton_python_backend_utils")
    fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    fake.InferenceResponse = FakeResponse
    fake.Tensor = FakeTensor
    fake.TritonError = FakeError
    fake.MetricFamily = FakeFamily
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = fake
    for name in ("specserve.serving.triton_model", "specserve.serving.metrics"):
        sys.modules.pop(name, None)
    import specserve.serving.triton_model as module

    yield module
    for name in ("specserve.serving.triton_model", "specserve.serving.metrics"):
        sys.modules.pop(name, None)
    if saved is not None:
        sys.modules["triton_python_backend_utils"] = saved
    else:
        del sys.modules["triton_python_backend_utils"]


class FakeSender:
    def __init__(self, cancelled: bool | Exception = False) -> None:
        self.sent: list[tuple[FakeResponse | None, int]] = []
        self.cancelled, self.polled_on = cancelled, []  # an Exception: what `is_cancelled` raises

    def send(self, response: FakeResponse | None = None, flags: int = 0) -> None:
        assert not any(f & FINAL for _, f in self.sent), "nothing may follow FINAL"
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        self.polled_on.append(threading.current_thread().name)
        if isinstance(self.cancelled, Exception):
            raise self.cancelled
        return self.cancelled

    @property
    def finals(self) -> int:
        return sum(1 for _, f in self.sent if f & FINAL)

    @property
    def data(self) -> list[FakeResponse]:
        return [r for r, _ in self.sent if r is not None and r.error is None]


def out(text: str, ids: list[int], finished: bool = False, reason: str | None = None, **kw: Any):
    from specserve.engine.outputs import RequestOutput

    return RequestOutput("r", ids, text, finished=finished, finish_reason=reason, num_prompt_tokens=5, **kw)


def stream_for(triton_model, stream: bool, echo: str | None = None, closing: bool = False, wanted=None):
    from specserve.config import SamplingParams
    from specserve.serving.contract import GenerateRequest
    from specserve.serving.metrics import ServingMetrics

    event = threading.Event()
    if closing:
        event.set()
    sender = FakeSender()
    s = triton_model._ResponseStream(sender, GenerateRequest(SamplingParams(), stream, echo), ServingMetrics("m", "1"),
                                     event, decode_token=lambda t: f"<{t}>", wanted=wanted)
    return s, sender


def test_streaming_sends_each_delta_and_final_on_the_last(triton_model):
    s, sender = stream_for(triton_model, stream=True)
    s.handle(out("Hel", [1], num_output_tokens=1))
    s.handle(out("lo", [2], num_output_tokens=2, num_verify_steps=1, accept_lengths=[1]))
    s.handle(out("!", [3], True, "stop", num_output_tokens=3, num_verify_steps=2, accept_lengths=[1]))
    assert [f for _, f in sender.sent] == [0, 0, FINAL]
    texts = [r.outputs()["text_output"][0].decode() for r in sender.data]
    assert texts == ["Hel", "lo", "!"]
    last = sender.data[-1].outputs()
    assert last["finish_reason"][0] == b"stop"
    assert [r.outputs()["num_output_tokens"][0] for r in sender.data] == [1, 1, 1]  # per response, as vLLM's backend
    assert sender.data[0].outputs()["finish_reason"][0] == b""


def test_non_streaming_sends_one_response_then_a_flag_only_final(triton_model):
    s, sender = stream_for(triton_model, stream=False, echo="Q: ")
    s.handle(out("Hel", [1]))
    s.handle(out("lo", [2]))
    s.handle(out("", [], True, "length", num_output_tokens=2))
    assert len(sender.data) == 1 and sender.sent[-1] == (None, FINAL) and sender.finals == 1
    outputs = sender.data[0].outputs()
    assert outputs["text_output"][0].decode() == "Q: Hello"
    assert outputs["output_ids"].tolist() == [1, 2] and outputs["num_output_tokens"][0] == 2
    assert outputs["logprobs"][0] == b"null"


def test_logprobs_are_sent_per_token_and_accumulated_without_streaming(triton_model):
    import json

    s, sender = stream_for(triton_model, stream=False)
    s.handle(out("a", [1], logprobs=[{1: (-0.5, 1)}], cumulative_logprob=-0.5))
    s.handle(out("b", [2], True, "stop", logprobs=[{2: (-1.0, 2), 7: (-0.2, 1)}], cumulative_logprob=-1.5))
    outputs = sender.data[0].outputs()
    assert json.loads(outputs["logprobs"][0]) == [
        {"1": {"logprob": -0.5, "rank": 1, "decoded_token": "<1>"}},
        {"2": {"logprob": -1.0, "rank": 2, "decoded_token": "<2>"},
         "7": {"logprob": -0.2, "rank": 1, "decoded_token": "<7>"}},
    ]
    assert outputs["cumulative_logprob"][0] == pytest.approx(-1.5)


@pytest.mark.parametrize(
    ("reason", "closing", "code"),
    [("abort", False, FakeError.CANCELLED), ("abort", True, FakeError.UNAVAILABLE),
     ("error", False, FakeError.INTERNAL), ("timeout", False, FakeError.UNAVAILABLE)],
)
@pytest.mark.parametrize("stream", [True, False])
def test_abort_and_error_end_with_an_error_and_final(triton_model, reason, closing, code, stream):
    s, sender = stream_for(triton_model, stream=stream, closing=closing)
    s.handle(out("a", [1]))
    s.handle(out("", [], True, reason, error="boom" if reason == "error" else None))
    response, flags = sender.sent[-1]
    assert flags == FINAL and sender.finals == 1
    assert response.error is not None and response.error.code == code


def test_metrics_follow_the_deltas(triton_model):
    FakeFamily.created.clear()
    s, _ = stream_for(triton_model, stream=True)
    s.handle(out("a", [1, 2], num_draft_tokens=4, num_accepted_tokens=1, num_verify_steps=1, accept_lengths=[2]))
    s.handle(out("b", [3], True, "stop", num_output_tokens=3, num_draft_tokens=8, num_accepted_tokens=1,
                 num_verify_steps=2, accept_lengths=[1]))

    def values(name: str) -> list[float]:
        return FakeFamily.created["specserve:" + name].metrics[0][1].values

    assert values("generation_tokens_total") == [2.0, 1.0]
    assert values("spec_decode_num_draft_tokens_total") == [4.0, 4.0]
    assert values("spec_decode_num_accepted_tokens_total") == [1.0]
    assert values("spec_decode_accept_length") == [2.0, 1.0]
    assert values("prompt_tokens_total") == [5.0]
    assert len(values("time_to_first_token_seconds")) == 1
    stop = [m for labels, m in FakeFamily.created["specserve:request_finished_total"].metrics
            if labels["finish_reason"] == "stop"]
    assert stop[0].values == [1.0]


class FakeRequest:
    def __init__(self, inputs: dict[str, np.ndarray], requested: tuple[str, ...] = ()) -> None:
        self._inputs, self.requested = inputs, requested
        self.sender = FakeSender()

    def requested_output_names(self) -> list[str]:
        return list(self.requested)

    def inputs(self) -> list[Any]:
        return [types.SimpleNamespace(name=lambda n=n: n, as_numpy=lambda a=a: a) for n, a in self._inputs.items()]

    def get_response_sender(self) -> FakeSender:
        return self.sender


class FakeLoop:
    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.submitted = error, []

    def submit(self, prompt_ids, params, on_output, request_id=None):
        if self.error:
            raise self.error
        self.submitted.append((prompt_ids, params))
        return "r"


class FakeTritonThread:
    def __init__(self) -> None:
        self.opened: list[tuple[str, Any]] = []

    def open(self, request_id: str, stream: Any) -> None:
        self.opened.append((request_id, stream))


def model_with(triton_model, loop: FakeLoop):
    from specserve.serving.contract import RequestLimits

    m = triton_model.TritonPythonModel()
    m.limits = RequestLimits(max_seq_len=64)
    m.tokenizer = types.SimpleNamespace(encode=lambda text, chat: [ord(c) for c in text], decode_token=chr)
    m.metrics = None
    m.closing = threading.Event()
    m.triton_thread = FakeTritonThread()
    m.loop = loop
    return m


def text(s: str) -> np.ndarray:
    return np.array([s.encode()], dtype=np.object_)


def test_execute_submits_and_sends_nothing_yet(triton_model):
    loop = FakeLoop()
    m = model_with(triton_model, loop)
    request = FakeRequest({"text_input": text("hi"), "max_tokens": np.array([3], dtype=np.int32)}, ("output_ids",))
    assert m.execute([request]) is None
    (ids, params), = loop.submitted
    assert ids == [ord("h"), ord("i")] and params.max_tokens == 3
    (request_id, stream), = m.triton_thread.opened  # its cancellation is polled from now on
    assert request_id == "r" and stream.sender is request.sender and stream.wanted == {"output_ids"}
    assert request.sender.sent == []


@pytest.mark.parametrize(
    ("inputs", "loop_error", "code", "field"),
    [
        ({"text_input": text("hi"), "max_tokens": np.array([0], dtype=np.int32)}, None, FakeError.INVALID_ARG,
         "max_tokens"),
        ({"text_input": text("x" * 100)}, None, FakeError.INVALID_ARG, "text_input"),
        ({"text_input": text("hi")}, ValueError("prompt: token id outside the vocabulary"), FakeError.INVALID_ARG,
         "prompt"),
        ({"text_input": text("hi")}, RuntimeError("kaput"), FakeError.INTERNAL, "internal error"),
        ({"text_input": text("hi")}, QueueFull("max_queue_size: 4 requests are already waiting"), FakeError.UNAVAILABLE,
         "max_queue_size"),
        ({"text_input": text("hi")}, EngineStopped("engine stopped: device lost"), FakeError.UNAVAILABLE,
         "engine stopped"),
    ],
)
def test_execute_errors_end_with_final(triton_model, inputs, loop_error, code, field):
    m = model_with(triton_model, FakeLoop(loop_error))
    request = FakeRequest(inputs)
    m.execute([request])
    (response, flags), = request.sender.sent
    assert flags == FINAL and response.error.code == code and response.error.message.startswith(field)


class SpyTokenizer:
    """The fake tokenizer of `model_with` (a token per character), counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, apply_chat_template: bool) -> list[int]:
        self.calls += 1
        if text == "crash":
            raise RuntimeError("tokenizer bug")
        return [ord(c) for c in text]

    def decode_token(self, token_id: int) -> str:
        return chr(token_id)


def forged_config(**params: Any) -> np.ndarray:
    """A `request_config` as any client may send it straight to llm_<variant>."""
    payload = {"params": {"max_tokens": 4, **params}, "stream": True, "echo_text": None}
    return np.array([json.dumps(payload).encode()], dtype=np.object_)


def serving_model(triton_model, loop: FakeLoop):
    from specserve.serving.metrics import ServingMetrics

    m = model_with(triton_model, loop)
    m.tokenizer, m.metrics = SpyTokenizer(), ServingMetrics("llm_none", "1")
    return m


def ok_request() -> FakeRequest:
    return FakeRequest({"text_input": text("hi"), "stream": np.array([True]),
                        "max_tokens": np.array([2], dtype=np.int32)})


def forged(request_config: np.ndarray) -> dict[str, np.ndarray]:
    return {"input_ids": np.array([5, 6], dtype=np.int32), "request_config": request_config}


BAD_REQUESTS = [
    (forged(forged_config(top_k=5.5)), "top_k"),
    (forged(forged_config(logprobs=1.5)), "logprobs"),
    (forged(forged_config(temperature=True)), "temperature"),
    (forged(text("[" * 50_000)), "request_config"),
    ({"text_input": text("hi"), "sampling_parameters": text("[" * 50_000)}, "sampling_parameters"),
    ({"text_input": text("hi"), "sampling_parameters": text('{"top_k": 5.5}')}, "sampling_parameters.top_k"),
    ({"text_input": text("hi"), "stop_words": np.array([b"s"] * 17, dtype=np.object_)}, "stop_words"),
    ({"text_input": text("x" * 16_385)}, "text_input"),  # over the bound of a 64-token context
]
BAD_REQUEST_IDS = [f"{i}-{field}" for i, (_, field) in enumerate(BAD_REQUESTS)]


def execute_between_good_requests(m: Any, loop: FakeLoop, bad: FakeRequest) -> str:
    """`execute([good, bad, good])`: the bad one ends with INVALID_ARG + FINAL (its message is returned),
    the good ones are submitted and each ends with one FINAL once the engine finishes them."""
    first, last = ok_request(), ok_request()
    m.execute([first, bad, last])
    (response, flags), = bad.sender.sent
    assert flags == FINAL and response.error.code == FakeError.INVALID_ARG
    assert [ids for ids, _ in loop.submitted] == [[ord("h"), ord("i")]] * 2
    for _, stream in m.triton_thread.opened:  # the engine's outputs of the two good requests
        stream.handle(out("a", [97], True, "stop", num_output_tokens=1))
    for request in (first, last):
        assert request.sender.finals == 1 and request.sender.data[-1].outputs()["finish_reason"][0] == b"stop"
    return response.error.message


@pytest.mark.parametrize(("bad", "field"), BAD_REQUESTS, ids=BAD_REQUEST_IDS)
def test_a_bad_request_is_answered_alone_and_the_others_are_served(triton_model, bad, field):
    loop = FakeLoop()
    message = execute_between_good_requests(serving_model(triton_model, loop), loop, FakeRequest(bad))
    assert message.startswith(f"{field}:")


def test_a_100_mb_prompt_is_refused_without_tokenizing_it(triton_model):
    loop = FakeLoop()
    m = serving_model(triton_model, loop)
    huge = FakeRequest({"text_input": np.array([b"x" * 100_000_000], dtype=np.object_)})
    start = time.perf_counter()
    message = execute_between_good_requests(m, loop, huge)
    assert time.perf_counter() - start < 2.0
    assert m.tokenizer.calls == 2  # the two good requests only
    assert message.startswith("text_input: 100000000 bytes, more than the 16384 allowed")


@pytest.fixture(scope="module")
def preprocess(triton_model):
    """specserve.serving.triton_preprocess, imported with the fake triton_python_backend_utils."""
    sys.modules.pop("specserve.serving.triton_preprocess", None)
    import specserve.serving.triton_preprocess as module

    yield module
    sys.modules.pop("specserve.serving.triton_preprocess", None)


def test_preprocessing_answers_each_request_on_its_own(preprocess):
    from specserve.serving.contract import RequestLimits

    m = preprocess.TritonPythonModel()
    m.limits, m.tokenizer = RequestLimits(max_seq_len=64), SpyTokenizer()
    requests = [
        ok_request(),
        FakeRequest({"text_input": text("hi"), "sampling_parameters": text("[" * 50_000)}),
        FakeRequest({"text_input": np.array([b"x" * 100_000_000], dtype=np.object_)}),
        FakeRequest({"text_input": text("crash")}),  # an unexpected failure: INTERNAL, for this request only
        ok_request(),
    ]
    responses = m.execute(requests)
    assert [r.error.code if r.error else None for r in responses] == [
        None, FakeError.INVALID_ARG, FakeError.INVALID_ARG, FakeError.INTERNAL, None]
    assert responses[1].error.message == "sampling_parameters: nested too deeply"
    assert responses[2].error.message.startswith("text_input: 100000000 bytes")
    assert responses[3].error.message == "internal error: RuntimeError: tokenizer bug"
    assert responses[0].outputs()["input_ids"].tolist() == [ord("h"), ord("i")]
    assert m.tokenizer.calls == 3  # never for the refused ones


def test_a_failed_final_send_still_ends_the_request(triton_model):
    s, sender = stream_for(triton_model, stream=False)
    real_send = sender.send

    def failing_send(response=None, flags=0):
        if response is not None and response.error is None:
            raise RuntimeError("tensor too large")
        real_send(response, flags)

    sender.send = failing_send
    thread = triton_model._TritonThread(abort=print, set_load=print)
    thread.put(s, out("a", [1], True, "stop"))
    thread.close()
    (response, flags), = sender.sent
    assert flags == FINAL and response.error.code == FakeError.INTERNAL


def _wait_for(condition, timeout_s: float = 2.0) -> bool:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        threading.Event().wait(0.01)
    return condition()


# a sender that cannot say whether it is cancelled: nobody can receive its tokens, its slot must go too
@pytest.mark.parametrize("cancelled", [True, RuntimeError("the stub lost its parent")], ids=["cancelled", "fails"])
def test_cancellation_is_polled_on_the_triton_thread_and_aborts_the_request(triton_model, cancelled):
    aborted: list[str] = []
    thread = triton_model._TritonThread(abort=aborted.append, set_load=print, poll_interval_s=0.01)
    s, sender = stream_for(triton_model, stream=True)
    sender.cancelled = cancelled
    thread.open("r1", s)
    assert _wait_for(lambda: aborted == ["r1"])
    threading.Event().wait(0.05)
    assert aborted == ["r1"]  # aborted once, then no longer polled
    thread.put(s, out("", [], True, "abort"))  # the engine's abort output: the request's FINAL
    thread.close()
    assert set(sender.polled_on) == {"specserve-triton"}
    (response, flags), = sender.sent
    assert flags == FINAL and response.error.code == FakeError.CANCELLED


def test_a_request_is_never_polled_after_its_last_output(triton_model):
    aborted: list[str] = []
    thread = triton_model._TritonThread(abort=aborted.append, set_load=print, poll_interval_s=0.01)
    done, done_sender = stream_for(triton_model, stream=True)
    thread.put(done, out("a", [1], True, "stop"))  # finished before `open` reached the thread
    thread.open("r1", done)
    running, running_sender = stream_for(triton_model, stream=True)
    thread.open("r2", running)
    assert _wait_for(lambda: len(running_sender.polled_on) >= 3)
    thread.put(running, out("b", [2], True, "stop"))
    threading.Event().wait(0.05)
    polls = len(running_sender.polled_on)
    threading.Event().wait(0.05)
    thread.close()
    assert done_sender.polled_on == [] and len(running_sender.polled_on) == polls and aborted == []
    assert done_sender.finals == 1 and running_sender.finals == 1


def test_the_load_gauges_are_set_on_the_triton_thread(triton_model):
    from specserve.engine.outputs import EngineLoad

    seen: list[tuple[EngineLoad, str]] = []
    thread = triton_model._TritonThread(abort=print, set_load=lambda load: seen.append(
        (load, threading.current_thread().name)))
    thread.load(EngineLoad(waiting=1, running=2, kv_slots_used=2))
    thread.close()
    assert seen == [(EngineLoad(1, 2, 2), "specserve-triton")]


def test_a_sent_response_and_its_tensors_stay_referenced_after_send(triton_model):
    """The stub's `send` runs with the GIL released: no last reference to a tensor may go with it."""
    import gc
    import weakref

    s, sender = stream_for(triton_model, stream=True)
    s.handle(out("a", [1]))
    response = sender.sent[-1][0]
    sent, tensors = weakref.ref(response), [weakref.ref(t) for t in response.output_tensors]
    del response
    sender.sent.clear()
    gc.collect()
    assert sent() is not None and all(t() is not None for t in tensors)


def test_a_response_holds_only_the_outputs_its_request_asked_for(triton_model):
    """The stub drops unrequested outputs with the GIL released (a heap corruption in r24.10): none are built."""
    s, sender = stream_for(triton_model, stream=True, wanted=frozenset({"output_ids", "finish_reason"}))
    s.handle(out("a", [1]))
    s.handle(out("b", [2], True, "stop"))
    assert [sorted(r.outputs()) for r, _ in sender.sent] == [["finish_reason", "output_ids"]] * 2
    assert sender.sent[-1][0].outputs()["output_ids"].tolist() == [2] and sender.finals == 1
    everything, sender = stream_for(triton_model, stream=True)  # no outputs named: every output
    everything.handle(out("a", [1], True, "stop"))
    assert {"text_output", "output_ids", "finish_reason", "num_output_tokens"} <= set(sender.sent[0][0].outputs())


def _backend_model_config(config: dict[str, Any]) -> Any:
    """The Python backend's own `ModelConfig` (what `auto_complete_config` receives), from the
    nvidia-pytriton wheel's copy of triton_python_backend_utils."""
    import importlib.util
    from pathlib import Path

    pytriton = pytest.importorskip("pytriton")
    path = Path(pytriton.__file__).parent / "tritonserver/backends/python/triton_python_backend_utils.py"
    spec = importlib.util.spec_from_file_location("backend_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ModelConfig(json.dumps(config))


def test_auto_complete_declares_the_tensors_and_the_decoupled_policy(triton_model):
    from specserve.serving.repository import llm_inputs, llm_outputs

    bare = {"name": "llm_none", "max_batch_size": 0, "input": [], "output": [], "parameters": {}}
    config = triton_model.TritonPythonModel.auto_complete_config(_backend_model_config(bare)).as_dict()
    assert config["input"] == llm_inputs() and config["output"] == llm_outputs()
    assert config["model_transaction_policy"] == {"decoupled": True} and config["max_batch_size"] == 0
    # a config that spells a tensor out itself (as the ensembles' do) is completed, not contradicted
    text_input = {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1], "optional": True}
    explicit = {**bare, "input": [dict(text_input)]}
    config = triton_model.TritonPythonModel.auto_complete_config(_backend_model_config(explicit)).as_dict()
    assert [t["name"] for t in config["input"]].count("text_input") == 1 and len(config["input"]) == len(llm_inputs())
