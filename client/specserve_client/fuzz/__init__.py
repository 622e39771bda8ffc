"""Fuzz a running server's request handling, as Triton's L0 tests do: thousands of malformed and
edge-case requests, beside greedy streams whose answers must not change.

    python -m specserve_client.fuzz --requests 2000 --out results/fuzz     # starts its own server
    python -m specserve_client.fuzz --url localhost:8001 --requests 150   # a running one
    python -m specserve_client.fuzz --url localhost:8001 --replay results/fuzz/summary.json

Hypothesis draws the requests, seeded (`--seed`), so a run repeats: wrong datatypes, shapes and
byte sizes for every input of the contract and of the internal `input_ids` / `request_config`
pair, shared-memory regions that do not exist, empty tensors, a missing `text_input`, invalid
UTF-8, deeply nested JSON, every `sampling_parameters` key with wrong types and edge values,
unknown keys, inputs and outputs, `request_config` + `input_ids` forged and sent to
`llm_<variant>` directly, many and long stop strings, edge values of every scalar tensor. Every
request that could be valid asks for at most `MAX_TOKENS` tokens. Beside the drawn ones, an edge
grid, the same every run: every `sampling_parameters` key with each of NaN, +-inf, -1, 0, 1e-40,
2**64, 5.5, true, a list, null and a 1 MB string; every INT32 / FP32 / UINT64 scalar input with its
type's edges; every `request_config` params field with each of 5.5, 1.5, -1, null, "5", true, [],
{}, NaN, 2**64; prompt ids outside the vocabulary and negative ones (2,000 requests hold the whole
grid, fewer hold evenly spaced cells of it). Each request goes on a gRPC stream of its own
(`--concurrency` in flight) to `llm_<variant>` or `ensemble_<variant>`.

A gRPC stream carries an error's message, not its status code (Triton's `triton_grpc_error`
header, which would carry it, crashes tritonserver 2.51: a stream with it whose request a model
refuses ends the server). So the status is read from the message, by the server's contract
(`classify`): a field name first (`max_tokens: ...`, `sampling_parameters.top_k: ...`, after the
ensemble's "in ensemble '...', ") is INVALID_ARGUMENT; a full queue ("max_queue_size: ... retry
later"), a timeout or a shutdown is UNAVAILABLE; Triton's own checks of datatypes, shapes, byte
sizes, names and shared memory, made before any model sees the request (INVALID_ARG in Triton),
are TRITON_REFUSED; "internal error", "engine error" are INTERNAL; any other message is
UNRECOGNIZED, a failure to look at.

Beside them `--greedy-streams` well-formed greedy streams (chat template, temperature 0) repeat a
few prompts until the fuzz ends; each answer must equal the first answer the same model gave to
the same prompt before the fuzz began (greedy float32 outputs do not depend on batching).

Checks: every fuzz request ends exactly once, within `--timeout-s`, either with one FINAL
response (at most `MAX_TOKENS` tokens) or with an INVALID_ARGUMENT, TRITON_REFUSED or UNAVAILABLE
error; the greedy answers stay the same; every model stays ready; tritonserver keeps its process
and its log gains no crash and no Python traceback (when this command started it, or `--pid` /
`--log` name them). Writes `<out>/summary.json`: outcomes per kind and status, sample messages,
the failures with their requests as JSON that `--replay` sends again; exits 1 on any failure.

It does not check that an invalid request is refused (a request may be answered or refused: the
unit tests of the server's parsing hold what each field accepts), measure speed, or cancel
requests (the soak does). Like the rest of `specserve_client` it imports nothing of `specserve`:
the contract's names and types are copied in `contract` (the e2e test keeps them equal to the
server's).

Modules: `contract` (the contract's copy, the request model and its JSON), `blocks` (the strategies'
building blocks), `malformed`, `edge_values` and `categories` (one strategy per category), `drawing`
(the edge grid and a run's requests), `checks` (statuses, sending and judging, the greedy streams,
readiness, the server's process and log), `cli` (the run, its summary and the command).
"""

from specserve_client.fuzz.categories import CATEGORIES
from specserve_client.fuzz.checks import (
    Outcome,
    ServerWatch,
    classify,
    send,
    status_name,
)
from specserve_client.fuzz.cli import (
    SERVER_PARAMETERS,
    FuzzConfig,
    load_requests,
    main,
    parse_args,
    replay,
    report,
    run,
    summarize,
)
from specserve_client.fuzz.contract import (
    ALLOWED,
    CONTRACT_INPUTS,
    DEFAULT_ONLY_KEYS,
    GREEDY_MAX_TOKENS,
    GREEDY_PROMPTS,
    INPUTS,
    INTERNAL_INPUTS,
    LOG_ALARMS,
    MAX_TOKENS,
    OUTPUTS,
    PARAMS_BASE,
    SAMPLING_KEYS,
    VARIABLE_LENGTH,
    VOCAB_SIZE,
    FuzzRequest,
    Long,
    TensorSpec,
    infer_input,
    request_from_json,
    request_to_json,
)
from specserve_client.fuzz.drawing import (
    GRID,
    KINDS,
    WEIGHTS,
    edge_grid,
    generate,
    shares,
)

__all__ = [
    "ALLOWED",
    "CONTRACT_INPUTS",
    "DEFAULT_ONLY_KEYS",
    "GREEDY_MAX_TOKENS",
    "GREEDY_PROMPTS",
    "INPUTS",
    "INTERNAL_INPUTS",
    "LOG_ALARMS",
    "MAX_TOKENS",
    "OUTPUTS",
    "PARAMS_BASE",
    "SAMPLING_KEYS",
    "VARIABLE_LENGTH",
    "VOCAB_SIZE",
    "FuzzRequest",
    "Long",
    "TensorSpec",
    "infer_input",
    "request_from_json",
    "request_to_json",
    "CATEGORIES",
    "GRID",
    "KINDS",
    "WEIGHTS",
    "edge_grid",
    "generate",
    "shares",
    "Outcome",
    "ServerWatch",
    "classify",
    "send",
    "status_name",
    "SERVER_PARAMETERS",
    "FuzzConfig",
    "load_requests",
    "main",
    "parse_args",
    "replay",
    "report",
    "run",
    "summarize",
]
