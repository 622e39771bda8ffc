"""The request contract of the Triton models: the tensors in and out, and their encodings.

The tensor contract is the one of Triton's vLLM and TensorRT-LLM backends (genai-perf and the
OpenAI frontend send it): `text_input` plus optional `stream`, `exclude_input_in_output`,
`sampling_parameters` (vLLM-style JSON, values may be strings as genai-perf sends them) and
TRT-LLM-style scalar tensors (`max_tokens`, `min_length`, `temperature`, ...). Outputs are one
response per engine delta (`output_arrays`).

Between `preprocessing` and `llm_<variant>` (the ensemble `ensemble_<variant>`) a request travels as
`input_ids` (INT32 [-1]) and `request_config` (BYTES [1]): the validated `GenerateRequest` as JSON
(`parsing.encode_request_config`).
This module validates nothing (`parsing` does) and imports no Triton.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from specserve.config import SamplingParams


class RequestError(ValueError):
    """A client error; the message starts with the field it is about."""


MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs allows
MAX_STOP_STRINGS = 16  # stop strings of a request (JSON `stop` or the `stop_words` tensor)
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_UTF8_BYTES_PER_CHAR = 4  # so a stop string is at most 1 KiB, checked before decoding
MAX_SAMPLING_PARAMETERS_BYTES = 64 * 1024  # 16 stop strings of 256 astral characters JSON-escaped fit
MAX_BYTES_PER_TOKEN = 256  # the longest token of a served vocabulary is shorter (see RequestLimits)
JSON_ESCAPE_FACTOR = 6  # JSON writes one control byte as six (\u00XX)


# ---- the contract ---------------------------------------------------------------------------

# name -> Triton datatype; every one is optional in config.pbtxt (missing text_input is our error).
CONTRACT_INPUTS: dict[str, str] = {
    "text_input": "BYTES",
    "stream": "BOOL",
    "exclude_input_in_output": "BOOL",
    "apply_chat_template": "BOOL",
    "sampling_parameters": "BYTES",
    "max_tokens": "INT32",
    "min_tokens": "INT32",
    "min_length": "INT32",  # TRT-LLM's name for min_tokens
    "temperature": "FP32",
    "top_p": "FP32",
    "top_k": "INT32",
    "seed": "UINT64",
    "random_seed": "UINT64",  # TRT-LLM's name for seed
    "ignore_eos": "BOOL",
    "stop_words": "BYTES",
    "bad_words": "BYTES",
    "beam_width": "INT32",
    "end_id": "INT32",  # accepted for TRT-LLM payloads; the model's EOS ids are always used
    "pad_id": "INT32",  # accepted for TRT-LLM payloads; nothing is padded in a stream
    "frequency_penalty": "FP32",
    "presence_penalty": "FP32",
    "repetition_penalty": "FP32",
    # TRT-LLM's structured output: json, json_schema, regex or ebnf_grammar, and its schema / regex / grammar
    "guided_decoding_guide_type": "BYTES",
    "guided_decoding_guide": "BYTES",
    # vLLM-backend flags: finish_reason and the token counts are always returned, logprobs and
    # cumulative_logprob carry "null" / 0 unless asked for; TRT-LLM's return_perf_metrics: the
    # speculative counters (total_draft_tokens ...) are always returned
    "return_num_input_tokens": "BOOL",
    "return_num_output_tokens": "BOOL",
    "return_finish_reason": "BOOL",
    "return_logprobs": "BOOL",
    "return_cumulative_logprob": "BOOL",
    "return_perf_metrics": "BOOL",
}
# preprocessing -> llm_<variant>
INTERNAL_INPUTS: dict[str, str] = {"input_ids": "INT32", "request_config": "BYTES"}

OUTPUTS: dict[str, str] = {
    "text_output": "BYTES",
    "output_ids": "INT32",
    "finish_reason": "BYTES",
    "num_input_tokens": "UINT32",
    "num_output_tokens": "UINT32",  # in this response (as vLLM's backend counts them)
    "num_cached_tokens": "UINT32",  # prompt tokens found in the prefix cache (vLLM's num_cached_tokens)
    "logprobs": "BYTES",  # JSON as vLLM's backend: per token {id: {logprob, rank, decoded_token}}, or null
    "cumulative_logprob": "FP32",
    "total_draft_tokens": "INT32",
    "total_accepted_draft_tokens": "INT32",
    "acceptance_rate": "FP32",
    "accept_length": "FP32",
}


@dataclass(frozen=True)
class RequestLimits:
    """Server-side bounds and defaults (config.pbtxt parameters), and the bounds derived from them.

    Sizes are checked before any work is spent on a request: a `text_input` before it is decoded
    or tokenized, `sampling_parameters` and `request_config` before they are parsed, `input_ids`
    before they are copied, every list tensor's entries before they are read.

    max_prompt_bytes = max_seq_len * MAX_BYTES_PER_TOKEN (512 KiB at the default 2048 tokens). A
    prompt that fits the context has fewer than max_seq_len tokens, so no more bytes than that many
    of the vocabulary's longest token (a byte-level BPE drops no byte). SmolLM2's longest token is
    81 bytes, a newline and 80 spaces; 256 leaves room for vocabularies with longer runs of spaces,
    `#` or `=`. So the bound refuses no prompt that could be served, and a 100 MB one costs a length
    check, not a decoding and a tokenization.
    """

    max_seq_len: int = 2048
    default_max_tokens: int = 128
    apply_chat_template: bool = False

    @property
    def max_tokens_limit(self) -> int:
        return self.max_seq_len - 1  # at least one prompt token must fit

    @property
    def max_prompt_bytes(self) -> int:
        """The most bytes of a `text_input` (see the class docstring)."""
        return self.max_seq_len * MAX_BYTES_PER_TOKEN

    @property
    def max_request_config_bytes(self) -> int:
        """The most bytes of a `request_config`: its echoed prompt and the sampling parameters (a
        structured output's schema or grammar among them), JSON-escaped (\\u00XX: six bytes for one)."""
        return JSON_ESCAPE_FACTOR * (self.max_prompt_bytes + MAX_SAMPLING_PARAMETERS_BYTES)


@dataclass(frozen=True)
class GenerateRequest:
    """What the decoupled model needs besides the prompt ids.

    echo_text: prepended to the (non-streamed) output when `exclude_input_in_output` is False,
    as vLLM's backend does; None otherwise.
    """

    params: SamplingParams
    stream: bool = False
    echo_text: str | None = None


@dataclass(frozen=True)
class ParsedRequest:
    text: str
    apply_chat_template: bool
    request: GenerateRequest


# ---- responses ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponseDelta:
    """One response's content: the text / ids delta and the request's cumulative counters."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_input_tokens: int
    num_output_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_verify_steps: int
    logprobs: list[dict[str, dict[str, Any]]] | None = None  # vLLM's backend format (`logprobs_entries`)
    cumulative_logprob: float = 0.0
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


def logprobs_entries(logprobs: list[dict[int, tuple[float, int]]],
                     decode: Callable[[int], str]) -> list[dict[str, dict[str, Any]]]:
    """The engine's per-token {id: (logprob, rank)} -> vLLM's backend format: per token
    {"<id>": {"logprob": float, "rank": int, "decoded_token": str}}."""
    return [
        {str(t): {"logprob": lp, "rank": rank, "decoded_token": decode(t)} for t, (lp, rank) in entry.items()}
        for entry in logprobs
    ]


def output_arrays(delta: ResponseDelta) -> dict[str, np.ndarray]:
    """The output tensors of one response (names and dtypes as OUTPUTS); num_output_tokens counts
    this response's tokens, as vLLM's backend does (a client sums them over a stream)."""
    steps = max(delta.num_verify_steps, 1)
    rate = delta.num_accepted_tokens / delta.num_draft_tokens if delta.num_draft_tokens else 0.0
    return {
        "text_output": np.array([delta.text.encode("utf-8")], dtype=np.object_),
        "output_ids": np.array(delta.token_ids, dtype=np.int32),
        "finish_reason": np.array([(delta.finish_reason or "").encode("utf-8")], dtype=np.object_),
        "num_input_tokens": np.array([delta.num_input_tokens], dtype=np.uint32),
        "num_output_tokens": np.array([delta.num_output_tokens], dtype=np.uint32),
        "num_cached_tokens": np.array([delta.num_cached_tokens], dtype=np.uint32),
        "logprobs": np.array([json.dumps(delta.logprobs).encode("utf-8")], dtype=np.object_),
        "cumulative_logprob": np.array([delta.cumulative_logprob], dtype=np.float32),
        "total_draft_tokens": np.array([delta.num_draft_tokens], dtype=np.int32),
        "total_accepted_draft_tokens": np.array([delta.num_accepted_tokens], dtype=np.int32),
        "acceptance_rate": np.array([rate], dtype=np.float32),
        "accept_length": np.array([(delta.num_accepted_tokens + delta.num_verify_steps) / steps], dtype=np.float32),
    }


