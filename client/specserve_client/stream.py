"""Talk to the served models: gRPC streaming, HTTP generate_stream (SSE), HTTP generate.

`llm_<variant>` takes vLLM's backend format (every input shaped [1]); `ensemble_<variant>` takes
TensorRT-LLM's ensemble format (a leading batch dimension: [1, 1]): pass `trtllm_format=True`.

Each streaming call is a generator of `Delta`s (text / token-id deltas as they arrive); the last
one carries the finish reason and the request's cumulative counters. `collect` folds a stream
into a `Generation`. A server-side error (bad input, cancellation, ...) raises `GenerateError`
with the server's message, which names the offending field.

    for delta in grpc_stream("localhost:8001", "llm_none", "Hello"):
        print(delta.text, end="", flush=True)
"""

from __future__ import annotations

import http.client
import json
import queue
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

STAT_OUTPUTS = (
    "num_input_tokens",
    "num_cached_tokens",
    "num_output_tokens",
    "total_draft_tokens",
    "total_accepted_draft_tokens",
    "acceptance_rate",
    "accept_length",
)
OUTPUTS = ("text_output", "output_ids", "finish_reason", *STAT_OUTPUTS)
_DTYPES = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64}
_INPUT_TYPES = {
    "text_input": "BYTES",
    "stream": "BOOL",
    "apply_chat_template": "BOOL",
    "exclude_input_in_output": "BOOL",
    "sampling_parameters": "BYTES",
    "max_tokens": "INT32",
    "min_tokens": "INT32",
    "temperature": "FP32",
    "top_p": "FP32",
    "top_k": "INT32",
    "seed": "UINT64",
    "ignore_eos": "BOOL",
    "stop_words": "BYTES",
    "frequency_penalty": "FP32",
    "presence_penalty": "FP32",
    "repetition_penalty": "FP32",
    "guided_decoding_guide_type": "BYTES",
    "guided_decoding_guide": "BYTES",
    "return_logprobs": "BOOL",
    "return_num_input_tokens": "BOOL",
    "return_num_output_tokens": "BOOL",
}


class GenerateError(RuntimeError):
    """The server answered with an error (its message names the field for bad input).

    status: the gRPC status ("StatusCode.UNAVAILABLE": retry later) or the HTTP status code, when known.
    """

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Delta:
    """One streamed response. `stats` (cumulative counters) is filled on every response."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
    time_s: float = 0.0  # since the request was sent


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: dict[str, float]
    num_responses: int
    time_to_first_token_s: float | None
    latency_s: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.latency_s if self.latency_s > 0 else 0.0


def collect(deltas: Iterator[Delta]) -> Generation:
    text, ids, last, first, n, counted = [], [], None, None, 0, 0.0
    start = time.perf_counter()
    for d in deltas:
        n += 1
        counted += d.stats.get("num_output_tokens", 0.0)
        text.append(d.text)
        ids.extend(d.token_ids)
        if first is None and d.token_ids:
            first = d.time_s
        last = d
    stats = dict(last.stats) if last else {}
    if "num_output_tokens" in stats:  # counted per response: the request's total is their sum
        stats["num_output_tokens"] = counted
    return Generation(
        text="".join(text),
        token_ids=ids,
        finish_reason=last.finish_reason if last else None,
        stats=stats,
        num_responses=n,
        time_to_first_token_s=first,
        latency_s=last.time_s if last else time.perf_counter() - start,
    )


def request_inputs(
    prompt: str,
    max_tokens: int | None = None,
    temperature: float | None = None,
    stream: bool = True,
    apply_chat_template: bool | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The contract inputs of one request as plain values (None = leave out, server default)."""
    values = {
        "text_input": prompt,
        "stream": stream,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "apply_chat_template": apply_chat_template,
        **extra,
    }
    return {k: v for k, v in values.items() if v is not None}


def _delta_from_arrays(get: Any, start: float) -> Delta:
    def scalar(name: str) -> float:
        arr = get(name)
        return arr.reshape(-1)[0].item() if arr is not None and arr.size else 0

    text_arr, ids_arr, reason_arr = get("text_output"), get("output_ids"), get("finish_reason")
    text = b"".join(text_arr.reshape(-1)).decode("utf-8") if text_arr is not None else ""
    reason = b"".join(reason_arr.reshape(-1)).decode("utf-8") if reason_arr is not None else ""
    return Delta(
        text=text,
        token_ids=ids_arr.reshape(-1).tolist() if ids_arr is not None else [],
        finish_reason=reason or None,
        stats={name: scalar(name) for name in STAT_OUTPUTS},
        time_s=time.perf_counter() - start,
    )


# ---- gRPC -----------------------------------------------------------------------------------


def grpc_inputs(values: Mapping[str, Any], trtllm_format: bool = False) -> list[Any]:
    """InferInputs for plain values: shape [n] (vLLM's format) or, with trtllm_format, [1, n]."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in values.items():
        dtype = _INPUT_TYPES[name]
        arr = np.array(value if isinstance(value, list) else [value], dtype=_DTYPES[dtype])
        if dtype == "BYTES":
            arr = np.array([v.encode("utf-8") if isinstance(v, str) else v for v in arr], dtype=np.object_)
        if trtllm_format:
            arr = arr[None]
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def grpc_stream(url: str, model: str, prompt: str, timeout_s: float = 600.0, trtllm_format: bool = False,
                client: Any = None, **kwargs: Any) -> Iterator[Delta]:
    """Stream one request over gRPC (`start_stream` / `async_stream_infer`).

    Closing the generator early cancels the request on the server (`stop_stream(cancel_requests=True)`).
    kwargs: as `request_inputs` (max_tokens, temperature, stream, apply_chat_template, ...).
    trtllm_format: shape the inputs [1, 1], as `ensemble_<variant>` takes them.
    client: a `tritonclient.grpc.InferenceServerClient` to stream on (its connection kept, one
    stream at a time); by default one of its own, closed afterwards.
    """
    return grpc_stream_inputs(url, model, grpc_inputs(request_inputs(prompt, **kwargs), trtllm_format), timeout_s,
                              client)


def grpc_stream_inputs(url: str, model: str, inputs: list[Any], timeout_s: float = 600.0,
                       client: Any = None) -> Iterator[Delta]:
    """`grpc_stream` for ready-made `InferInput`s (any names and types, e.g. to test validation)."""
    import tritonclient.grpc as grpcclient

    responses: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
    own = client is None
    client = grpcclient.InferenceServerClient(url) if own else client
    finished = False
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        start = time.perf_counter()
        client.async_stream_infer(
            model, inputs, outputs=[grpcclient.InferRequestedOutput(n) for n in OUTPUTS],
            enable_empty_final_response=True
        )
        while True:
            try:
                result, error = responses.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no response from {model} within {timeout_s}s") from None
            if error is not None:
                finished = True
                raise GenerateError(error.message() if hasattr(error, "message") else str(error),
                                    error.status() if hasattr(error, "status") else None)
            final = result.get_response().parameters["triton_final_response"].bool_param
            if result.get_response().outputs:
                yield _delta_from_arrays(result.as_numpy, start)
            if final:
                finished = True
                return
    finally:
        client.stop_stream(cancel_requests=not finished)
        if own:
            client.close()


# ---- HTTP -----------------------------------------------------------------------------------


def _http_connection(url: str, timeout_s: float) -> http.client.HTTPConnection:
    host = url.removeprefix("http://")
    return http.client.HTTPConnection(host, timeout=timeout_s)


def _delta_from_json(obj: Mapping[str, Any], start: float) -> Delta:
    if "error" in obj:
        raise GenerateError(str(obj["error"]))

    def get(name: str) -> np.ndarray | None:
        if name not in obj:
            return None
        v = obj[name]
        if name in ("text_output", "finish_reason"):
            items = v if isinstance(v, list) else [v]
            return np.array([str(s).encode("utf-8") for s in items], dtype=np.object_)
        return np.array(v if isinstance(v, list) else [v])

    return _delta_from_arrays(get, start)


def http_generate_stream(url: str, model: str, prompt: str, timeout_s: float = 600.0, **kwargs: Any) -> Iterator[Delta]:
    """POST /v2/models/<model>/generate_stream and parse its server-sent events."""
    return http_stream_inputs(url, model, request_inputs(prompt, **{"stream": True, **kwargs}), timeout_s)


def http_stream_inputs(url: str, model: str, values: Mapping[str, Any], timeout_s: float = 600.0) -> Iterator[Delta]:
    """`http_generate_stream` for a ready-made JSON body (any keys, e.g. to test validation)."""
    conn = _http_connection(url, timeout_s)
    try:
        start = time.perf_counter()
        body = json.dumps(values)
        conn.request("POST", f"/v2/models/{model}/generate_stream", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise GenerateError(_http_error(resp), str(resp.status))
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if line.startswith("data:"):
                yield _delta_from_json(json.loads(line[5:]), start)
    finally:
        conn.close()  # closing the connection early cancels the request


def http_generate(url: str, model: str, prompt: str, timeout_s: float = 600.0, **kwargs: Any) -> Generation:
    """POST /v2/models/<model>/generate: one JSON response with the whole text (stream=false)."""
    conn = _http_connection(url, timeout_s)
    try:
        start = time.perf_counter()
        body = json.dumps(request_inputs(prompt, **{**kwargs, "stream": False}))
        conn.request("POST", f"/v2/models/{model}/generate", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise GenerateError(_http_error(resp), str(resp.status))
        delta = _delta_from_json(json.loads(resp.read()), start)
    finally:
        conn.close()
    return Generation(
        text=delta.text,
        token_ids=delta.token_ids,
        finish_reason=delta.finish_reason,
        stats=delta.stats,
        num_responses=1,
        time_to_first_token_s=None,
        latency_s=delta.time_s,
    )


def _http_error(resp: http.client.HTTPResponse) -> str:
    """The error of a non-200 answer (generate_stream sends it as an SSE `data:` line)."""
    raw = resp.read().decode("utf-8", errors="replace").strip()
    body = raw.removeprefix("data:").strip()
    try:
        return str(json.loads(body).get("error", body))
    except (json.JSONDecodeError, AttributeError):
        return f"HTTP {resp.status}: {raw}"


def stream(protocol: str, url: str, model: str, prompt: str, **kwargs: Any) -> Iterator[Delta]:
    """`grpc` or `http` (generate_stream)."""
    if protocol == "grpc":
        return grpc_stream(url, model, prompt, **kwargs)
    if protocol == "http":
        return http_generate_stream(url, model, prompt, **kwargs)
    raise ValueError(f"protocol: expected grpc or http, got {protocol!r}")
