"""The request contract the fuzz sends to, and the fuzz's requests: the server contract's inputs,
outputs, sampling keys and `request_config` params (copies, kept equal to the server's by the e2e
test), the limits every check reads, the request model (`Long`, `TensorSpec`, `FuzzRequest`), its
JSON round trip (`request_to_json` / `request_from_json`, what `--replay` reads) and `infer_input`,
which turns a tensor spec into what tritonclient sends.

It draws no request (no Hypothesis here), sends none and checks none.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

# ---- the contract (equal to the server's contract, parsing and SamplingParams: tested) ----------

CONTRACT_INPUTS: dict[str, str] = {
    "text_input": "BYTES", "stream": "BOOL", "exclude_input_in_output": "BOOL",
    "apply_chat_template": "BOOL", "sampling_parameters": "BYTES", "max_tokens": "INT32",
    "min_tokens": "INT32", "min_length": "INT32", "temperature": "FP32", "top_p": "FP32", "top_k": "INT32",
    "seed": "UINT64", "random_seed": "UINT64", "ignore_eos": "BOOL", "stop_words": "BYTES",
    "bad_words": "BYTES", "beam_width": "INT32", "end_id": "INT32", "pad_id": "INT32",
    "frequency_penalty": "FP32", "presence_penalty": "FP32", "repetition_penalty": "FP32",
    "guided_decoding_guide_type": "BYTES", "guided_decoding_guide": "BYTES",
    "return_num_input_tokens": "BOOL", "return_num_output_tokens": "BOOL", "return_finish_reason": "BOOL",
    "return_logprobs": "BOOL", "return_cumulative_logprob": "BOOL", "return_perf_metrics": "BOOL",
}
INTERNAL_INPUTS: dict[str, str] = {"input_ids": "INT32", "request_config": "BYTES"}
INPUTS: dict[str, str] = {**CONTRACT_INPUTS, **INTERNAL_INPUTS}
VARIABLE_LENGTH = frozenset({"stop_words", "bad_words", "input_ids"})  # dims [-1] (after a batch dim)
OUTPUTS = ("text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens",
           "num_cached_tokens", "logprobs", "cumulative_logprob", "total_draft_tokens",
           "total_accepted_draft_tokens", "acceptance_rate", "accept_length")
# sampling_parameters keys: those with a value (and vLLM's cache_salt), those taken only at vLLM's default
SAMPLING_KEYS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "cache_salt")
DEFAULT_ONLY_KEYS = ("n", "best_of", "min_p", "use_beam_search", "include_stop_str_in_output",
                     "skip_special_tokens")
# request_config's params: SamplingParams' fields, each with a safe value (None-valued ones left out)
PARAMS_BASE: dict[str, Any] = {
    "max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": [], "min_tokens": 0,
    "ignore_eos": False, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "logprobs": None, "cache_salt": None, "structured_output": None,
}

MAX_TOKENS = 8  # the most any request that could be valid asks for
VOCAB_SIZE = 49152  # SmolLM2's; token ids at and above it are outside the vocabulary
ALLOWED = ("OK", "INVALID_ARGUMENT", "TRITON_REFUSED", "UNAVAILABLE")  # how a fuzz request may end
LOG_ALARMS = ("Segmentation fault", "Traceback", "Fatal Python error", "core dumped", "is not healthy",
              "Signal (", "signal 11")
GREEDY_PROMPTS = ("What is the capital of France?", "Name three primary colors.",
                  "Write one sentence about the sea.", "What is 2 + 2?")
GREEDY_MAX_TOKENS = 24

NUMPY_TYPES: dict[str, Any] = {
    "BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_,
}
INVALID_UTF8 = (b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xa0\xa1", b"\xe2\x82", b"\xe2\x28\xa1",
                b"\xf0\x28\x8c\xbc", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf",
                b"\xf8\x88\x80\x80\x80", b"Hello \x80 world")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


# ---- requests ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Long:
    """A BYTES element made of repeated pieces (`piece * times`, concatenated): a long value that
    stays short in the summary."""

    parts: tuple[tuple[bytes, int], ...]

    def materialize(self) -> bytes:
        return b"".join(piece * times for piece, times in self.parts)


@dataclass(frozen=True)
class TensorSpec:
    """One input as sent: its values flat, the declared shape (which need not fit them),
    `size_delta` bytes cut from (< 0) or added to (> 0) its raw content, or a shared-memory region
    instead of data."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    values: tuple[Any, ...]
    size_delta: int = 0
    shm_region: str | None = None


@dataclass(frozen=True)
class FuzzRequest:
    kind: str  # the category that drew it
    model: str
    tensors: tuple[TensorSpec, ...]
    outputs: tuple[str, ...] = ("text_output", "output_ids", "finish_reason")


def _bytes_to_json(value: bytes | Long) -> dict[str, Any]:
    if isinstance(value, Long):
        return {"long": [_bytes_to_json(piece) | {"times": times} for piece, times in value.parts]}
    try:
        return {"utf8": value.decode("utf-8")}
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(value).decode()}


def _bytes_from_json(obj: dict[str, Any]) -> bytes | Long:
    if "long" in obj:
        return Long(tuple((_piece_from_json(part), part["times"]) for part in obj["long"]))
    return _piece_from_json(obj)


def _piece_from_json(obj: dict[str, Any]) -> bytes:
    return obj["utf8"].encode("utf-8") if "utf8" in obj else base64.b64decode(obj["b64"])


def _tensor_to_json(t: TensorSpec) -> dict[str, Any]:
    values = [_bytes_to_json(v) for v in t.values] if t.datatype == "BYTES" else list(t.values)
    entry = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape), "values": values}
    entry |= {"size_delta": t.size_delta} if t.size_delta else {}
    return entry | ({"shm_region": t.shm_region} if t.shm_region is not None else {})


def _tensor_from_json(t: dict[str, Any]) -> TensorSpec:
    values = t["values"]
    values = tuple(_bytes_from_json(v) for v in values) if t["datatype"] == "BYTES" else tuple(values)
    return TensorSpec(t["name"], t["datatype"], tuple(t["shape"]), values, t.get("size_delta", 0),
                      t.get("shm_region"))


def request_to_json(request: FuzzRequest) -> dict[str, Any]:
    """The request as JSON (NaN and infinities as Python's json writes them); `request_from_json`
    and `--replay` read it back."""
    return {"kind": request.kind, "model": request.model, "outputs": list(request.outputs),
            "tensors": [_tensor_to_json(t) for t in request.tensors]}


def request_from_json(obj: dict[str, Any]) -> FuzzRequest:
    tensors = tuple(_tensor_from_json(t) for t in obj["tensors"])
    return FuzzRequest(obj["kind"], obj["model"], tensors, tuple(obj["outputs"]))


def infer_input(spec: TensorSpec) -> grpcclient.InferInput:
    """The tensor as tritonclient sends it: data set from its values, then the declared shape and
    the byte size changed as the spec says (tritonclient itself would refuse both)."""
    inp = grpcclient.InferInput(spec.name, [len(spec.values)], spec.datatype)
    if spec.shm_region is not None:
        inp.set_shared_memory(spec.shm_region, 4 * max(1, len(spec.values)))
    else:
        values = [v.materialize() if isinstance(v, Long) else v for v in spec.values]
        inp.set_data_from_numpy(np.array(values, dtype=NUMPY_TYPES[spec.datatype]).reshape(len(values)))
        raw, delta = inp._raw_content or b"", spec.size_delta
        if delta:
            inp._raw_content = raw[: len(raw) + delta] if delta < 0 else raw + b"\0" * delta
    inp.set_shape(list(spec.shape))
    return inp
