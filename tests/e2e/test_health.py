"""End-to-end health: faults injected into the engine of a real tritonserver's model.

The server runs llm_none and two copies of it whose engine fails on demand (see fault_model.py):
one whose steps fail, one whose engine thread dies outside a step. Each must end every open
request with an error FINAL, unload itself (Triton then reports it not ready), and leave the
other models serving.
"""

from __future__ import annotations

import queue
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from specserve.serving.server import TritonProcess, copy_repository, default_repository, free_port
from specserve_client.stream import GenerateError, collect, grpc_inputs, grpc_stream, request_inputs

pytestmark = pytest.mark.e2e

TIMEOUT_S = 120
FAULTY = {"llm_fault_step": "step", "llm_fault_loop": "loop"}


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the trigger files: `<model>.fault` makes that model's engine fail."""
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path, engine_params: dict[str, str],
           faults: Path) -> Iterator[TritonProcess]:
    root = tmp_path_factory.mktemp("triton-health")
    # eager engines: what is tested is how a failing engine ends its requests, not its forwards
    params = engine_params | {"disable_cpu_compile": "true"}
    repo = copy_repository(default_repository(), root / "model_repository", {"llm_none": params})
    for model, fault_in in FAULTY.items():
        (repo / model / "1").mkdir(parents=True)
        shutil.copy(Path(__file__).with_name("fault_model.py"), repo / model / "1" / "model.py")
        fault = {"fault_file": str(faults / f"{model}.fault"), "fault_in": fault_in}
        (repo / model / "config.pbtxt").write_text((repo / "llm_none" / "config.pbtxt").read_text() + "".join(
            f'parameters: {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in fault.items()))
    process = TritonProcess(repo, ["llm_none", *FAULTY], free_port(), free_port(), free_port(),
                            log=root / "tritonserver.log")
    with process:
        yield process


def _open_stream(url: str, model: str, prompt: str) -> tuple[grpcclient.InferenceServerClient, queue.SimpleQueue]:
    """A long greedy stream; its responses (result, error) arrive on the queue."""
    results: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(
        model, grpc_inputs(request_inputs(prompt, max_tokens=400, ignore_eos=True)),
        outputs=[grpcclient.InferRequestedOutput("output_ids")], enable_empty_final_response=True,
    )
    return client, results


def _error_of(results: queue.SimpleQueue) -> str:
    """Read a stream to its end: the message of the error that ended it; fails on a clean end."""
    while True:
        result, error = results.get(timeout=TIMEOUT_S)
        if error is not None:
            return error.message()
        assert not result.get_response().parameters["triton_final_response"].bool_param, "ended without an error"


def _not_ready_within(server: TritonProcess, model: str, timeout_s: float) -> bool:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not client.is_model_ready(model):
                return True
            time.sleep(0.2)
        return not client.is_model_ready(model)
    finally:
        client.close()


def _base_still_serves(server: TritonProcess) -> None:
    g = collect(grpc_stream(server.grpc_url, "llm_none", "Hi", max_tokens=4, timeout_s=TIMEOUT_S))
    assert len(g.token_ids) >= 1 and g.finish_reason in ("stop", "length")


def _first_token(results: queue.SimpleQueue) -> None:
    result, error = results.get(timeout=TIMEOUT_S)
    assert error is None and result.get_response().outputs, "the stream should be decoding"


def test_failed_steps_end_their_requests_then_the_model_unloads(server, faults):
    model = "llm_fault_step"
    client, results = _open_stream(server.grpc_url, model, "Count from 1 to 1000.")
    try:
        _first_token(results)
        (faults / f"{model}.fault").touch()
        message = _error_of(results)  # the in-flight request: ended by the first failed step
        assert message == "engine error: RuntimeError: injected fault in Engine.step"
    finally:
        client.stop_stream()
        client.close()
    # the next request waits while two more steps fail (max_failed_steps is 3): the loop stops and ends it
    with pytest.raises(GenerateError, match="engine stopped: RuntimeError: 3 engine steps failed in a row; "
                                            "last: RuntimeError: injected fault in Engine.step"):
        collect(grpc_stream(server.grpc_url, model, "Hi", max_tokens=4, timeout_s=TIMEOUT_S))
    assert _not_ready_within(server, model, 30), f"{model} stayed ready after 3 failed steps in a row"
    with pytest.raises(GenerateError):
        collect(grpc_stream(server.grpc_url, model, "Hi", max_tokens=4, timeout_s=TIMEOUT_S))
    _base_still_serves(server)


def test_a_dead_engine_thread_ends_every_open_request_then_the_model_unloads(server, faults):
    model = "llm_fault_loop"
    streams = [_open_stream(server.grpc_url, model, f"Count from {i} to 1000.") for i in range(3)]
    try:
        for _, results in streams:
            _first_token(results)
        (faults / f"{model}.fault").touch()
        for _, results in streams:
            assert _error_of(results) == "engine stopped: RuntimeError: injected fault in Engine.has_work"
    finally:
        for client, _ in streams:
            client.stop_stream()
            client.close()
    assert _not_ready_within(server, model, 30), f"{model} stayed ready after its engine thread died"
    _base_still_serves(server)
