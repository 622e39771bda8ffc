"""End-to-end request limits: oversized and deeply nested inputs are refused before any work.

A real tritonserver serves llm_none (an eager engine: what is tested is the refusal, not the
forwards) and ensemble_none. A 100 MB `text_input` reaches the model (tritonclient and Triton's
gRPC server both take messages up to 2 GB) and is refused by its length, never decoded nor
tokenized: quickly, and without the server's memory growing request after request.

Triton's gRPC front end itself keeps memory after a large message: its pool of request objects
kept for reuse (`--grpc-infer-allocation-pool-size`, 8 by default) keeps each one's buffers, and
glibc keeps freed blocks of up to 32 MB in its heaps (its dynamic mmap threshold). With the
defaults, tritonserver (not the models' stubs) grew by 200 to 400 MB over ten 100 MB requests
before it levelled off. The server here is started as a deployment taking such messages should
be: no pooled request objects, and blocks over 64 KiB mapped and unmapped on their own
(MALLOC_MMAP_THRESHOLD_), so that what is measured is what the requests leave behind.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from specserve.serving.contract import RequestLimits
from specserve.serving.server import TritonProcess, copy_repository, default_repository, free_port, models_for
from specserve_client.stream import GenerateError, collect, grpc_inputs, grpc_stream, grpc_stream_inputs

pytestmark = pytest.mark.e2e

TIMEOUT_S = 120
MAX_SEQ_LEN = 512
HUGE_BYTES = 100_000_000
REFUSED_WITHIN_S = 2.0
GROWTH_LIMIT_BYTES = 20_000_000
# what any client may send llm_<variant> instead of text_input: a type SamplingParams refuses
FORGED_CONFIG = json.dumps({"params": {"max_tokens": 2, "top_k": 5.5}, "stream": False})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path,
           engine_params: dict[str, str]) -> Iterator[TritonProcess]:
    root = tmp_path_factory.mktemp("triton-limits")
    params = engine_params | {"max_seq_len": str(MAX_SEQ_LEN), "disable_cpu_compile": "true"}
    overrides = {"llm_none": params, "preprocessing": {"max_seq_len": str(MAX_SEQ_LEN)}}
    repo = copy_repository(default_repository(), root / "model_repository", overrides)
    process = TritonProcess(repo, models_for(["none"]), free_port(), free_port(), free_port(),
                            log=root / "tritonserver.log", extra_args=["--grpc-infer-allocation-pool-size=0"])
    with contextlib.ExitStack() as running:
        with pytest.MonkeyPatch.context() as env:  # the server's environment, not this process's
            env.setenv("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
            running.enter_context(process)
        yield process


@pytest.fixture(scope="module")
def client(server: TritonProcess) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def huge_prompt() -> str:
    return "x" * HUGE_BYTES


def _server_rss_bytes(server: TritonProcess) -> int:
    """Resident memory of tritonserver and every process under it (the Python backend's stubs)."""
    assert server.proc is not None
    return sum(_rss_bytes(pid) for pid in _descendants(server.proc.pid))


def _descendants(root: int) -> list[int]:
    """`root` and the processes under it, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:  # the process ended meanwhile
        pass
    return 0


def _refusal(url: str, model: str, inputs: list, client: grpcclient.InferenceServerClient
             ) -> tuple[str, float]:
    """Send one request; the error that ends it and the seconds from sending it to that error."""
    start = time.perf_counter()
    with pytest.raises(GenerateError) as e:
        list(grpc_stream_inputs(url, model, inputs, TIMEOUT_S, client=client))
    return str(e.value), time.perf_counter() - start


def _still_serves(server: TritonProcess, model: str = "llm_none", **kwargs: object) -> None:
    g = collect(grpc_stream(server.grpc_url, model, "Hi", max_tokens=2, timeout_s=TIMEOUT_S, **kwargs))
    assert len(g.token_ids) >= 1 and g.finish_reason in ("stop", "length")


def test_a_100_mb_prompt_is_refused_at_once_and_costs_no_memory(server, client, huge_prompt):
    inputs = grpc_inputs({"text_input": huge_prompt, "max_tokens": 2})  # serialized once, before the clock
    message, first_s = _refusal(server.grpc_url, "llm_none", inputs, client)
    allowed = RequestLimits(max_seq_len=MAX_SEQ_LEN).max_prompt_bytes
    assert message.startswith(f"text_input: {HUGE_BYTES} bytes, more than the {allowed} allowed")
    time.sleep(1.0)  # let the server settle after the first transfer
    after_first = _server_rss_bytes(server)
    took = [first_s]
    for _ in range(10):
        message, took_s = _refusal(server.grpc_url, "llm_none", inputs, client)
        assert message.startswith("text_input:")
        took.append(took_s)
    # the median: one request slowed down by the rest of a busy host does not fail the test
    assert statistics.median(took) < REFUSED_WITHIN_S, f"the refusals took {took} s"
    time.sleep(1.0)
    grown = _server_rss_bytes(server) - after_first
    assert grown <= GROWTH_LIMIT_BYTES, f"ten refused 100 MB requests grew the server by {grown / 1e6:.1f} MB"
    _still_serves(server)


def test_a_100_mb_prompt_to_the_ensemble_is_refused_by_preprocessing(server, client, huge_prompt):
    inputs = grpc_inputs({"text_input": huge_prompt, "max_tokens": 2}, trtllm_format=True)
    took = []
    for _ in range(3):
        message, took_s = _refusal(server.grpc_url, "ensemble_none", inputs, client)
        assert f"text_input: {HUGE_BYTES} bytes" in message
        took.append(took_s)
    assert statistics.median(took) < REFUSED_WITHIN_S, f"the refusals took {took} s"
    _still_serves(server, "ensemble_none", trtllm_format=True)


@pytest.mark.parametrize(("depth", "message"), [
    (100_000, "sampling_parameters: 100000 bytes, more than the 65536 allowed"),  # refused by its size
    (50_000, "sampling_parameters: nested too deeply"),  # small enough to parse: refused by its depth
])
def test_nested_sampling_parameters_are_refused_and_the_model_stays_ready(server, client, depth, message):
    inputs = grpc_inputs({"text_input": "Hi", "sampling_parameters": "[" * depth})
    error, _ = _refusal(server.grpc_url, "llm_none", inputs, client)
    assert error == message
    assert client.is_model_ready("llm_none")
    _still_serves(server)


def _http_generate(url: str, model: str, body: dict) -> tuple[int, str]:
    """POST /v2/models/<model>/generate with a raw JSON body: the HTTP status and the error, if any."""
    conn = http.client.HTTPConnection(url, timeout=TIMEOUT_S)
    try:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", f"/v2/models/{model}/generate", json.dumps(body), headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read()).get("error", "")
    finally:
        conn.close()


@pytest.mark.parametrize(("body", "message"), [
    ({"text_input": "Hi", "sampling_parameters": "[" * 100_000}, "sampling_parameters: 100000 bytes"),
    ({"text_input": "Hi", "sampling_parameters": "[" * 50_000}, "sampling_parameters: nested too deeply"),
    ({"text_input": "Hi", "stop_words": ["s"] * 17}, "stop_words: at most 16 entries, got 17"),
    ({"input_ids": [5, 6], "request_config": FORGED_CONFIG}, "top_k: must be an integer, got 5.5"),
])
def test_refusals_are_invalid_argument(server, body, message):
    """Triton answers an INVALID_ARG error with HTTP 400 (gRPC streams carry no status per response)."""
    status, error = _http_generate(server.http_url, "llm_none", body)
    assert (status, error[: len(message)]) == (400, message)
    _still_serves(server)
