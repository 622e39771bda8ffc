"""Requests against a server and the checks of a run: an error's status read from its message
(`classify`), one request sent on a stream of its own and its outcome judged (`send`), the fuzz
workers, the greedy streams whose answers must not change, the readiness monitor and the watch on
tritonserver's process and log (`ServerWatch`).

It draws no request (`drawing`), starts no server and writes no summary (`cli`).
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from specserve_client.fuzz.blocks import FAMILIES
from specserve_client.fuzz.contract import (
    ALLOWED,
    GREEDY_MAX_TOKENS,
    GREEDY_PROMPTS,
    INPUTS,
    LOG_ALARMS,
    MAX_TOKENS,
    PARAMS_BASE,
    FuzzRequest,
    infer_input,
)
from specserve_client.stream import GenerateError, collect, grpc_stream

# ---- error statuses ----------------------------------------------------------------------------

ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")
REQUEST_ID_PREFIX = re.compile(r"^\[request id: [^\]]*\] ")
FIELD_FIRST = re.compile(r"^(?P<field>[a-z_]+)(?:\..*?)?: ", re.S)
FIELDS = frozenset(INPUTS) | frozenset(PARAMS_BASE) | {"prompt"}  # prompt: the engine's name for the ids
INTERNAL_SAYS = ("internal error", "engine error", "detokenization failed")
UNAVAILABLE_SAYS = (r"^max_queue_size: .*retry later$", r"^request timed out",
                    r"^(?:the )?server (?:is )?shutting down$")
TRITON_CHECKS = (  # tritonserver's own checks of a request, before any model sees it (INVALID_ARG)
    r"^inference input '.*' data-type is '\w+', but model '[^']*' expects",
    r"^unexpected shape for input '.*' for model '[^']*'\. Expected",
    r"^All input dimensions should be specified for input '.*' for model",
    r"^input byte size mismatch for input '.*' for model '[^']*'",
    r"^unexpected total byte size \d+ for input '.*'",
    r"^incomplete string (?:length indicator|data) for inference input '.*'",
    r"^(?:unexpected number of string elements|expected \d+ (?:string elements|buffers)) .*"
    r"for inference input",
    r"^expected (?:\d+|number of) inputs (?:between \d+ and \d+ )?but got \d+ inputs for model",
    r"^unexpected inference (?:input|output) '.*' for model '[^']*'$",
    r"^input '.*' already exists in request$",
    r"^Unable to find shared memory region: '.*'$",
)


def classify(message: str) -> str:
    """An error's status, read from its message by the server's contract (see the package's doc)."""
    text = REQUEST_ID_PREFIX.sub("", ENSEMBLE_PREFIX.sub("", message))
    if text.startswith(INTERNAL_SAYS):
        return "INTERNAL"
    if any(re.match(says, text, re.S) for says in UNAVAILABLE_SAYS):
        return "UNAVAILABLE"
    if text.startswith("request cancelled"):
        return "CANCELLED"
    if (m := FIELD_FIRST.match(text)) and m.group("field") in FIELDS:
        return "INVALID_ARGUMENT"
    if any(re.match(check, text, re.S) for check in TRITON_CHECKS):
        return "TRITON_REFUSED"
    return "UNRECOGNIZED"


def error_message(error: Any) -> str:
    return error.message() if hasattr(error, "message") else str(error)


def status_name(error: Any) -> str:
    """An error's status: the gRPC code where the client saw one (a broken connection), else the
    one its message says."""
    status = error.status() if hasattr(error, "status") else None
    return str(status).removeprefix("StatusCode.") if status else classify(error_message(error))


# ---- sending -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """How one request ended: "OK", an error's status, "TIMEOUT", "NOT_SENT" or "CLIENT_ERROR";
    `problem` says why it is a failure (None: it is not)."""

    status: str
    message: str = ""
    problem: str | None = None
    tokens: int = 0
    seconds: float = 0.0


def read_until_end(responses: queue.SimpleQueue, timeout_s: float, counts: Counter) -> Outcome | None:
    """Responses until a FINAL or an error; None on a FINAL (counts: responses, finals, tokens)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result, error = responses.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            problem = f"no end within {timeout_s:.0f} s ({counts['responses']} responses)"
            return Outcome("TIMEOUT", problem=problem)
        if error is not None:
            return Outcome(status_name(error), error_message(error))
        counts["responses"] += 1
        response = result.get_response()
        if any(o.name == "output_ids" for o in response.outputs):
            counts["tokens"] += result.as_numpy("output_ids").size
        if response.parameters["triton_final_response"].bool_param:
            counts["finals"] += 1
            return None


def judge(outcome: Outcome, request: FuzzRequest, counts: Counter, extra: int) -> Outcome:
    """Set `problem` where the outcome breaks a check (`extra`: responses after the end)."""
    if outcome.problem is None and outcome.status not in ALLOWED:
        outcome.problem = f"ended with {outcome.status}"
    elif outcome.status == "OK" and counts["finals"] != 1:
        outcome.problem = f"{counts['finals']} FINAL responses"
    elif outcome.status == "OK" and "output_ids" in request.outputs and counts["tokens"] > MAX_TOKENS:
        outcome.problem = f"{counts['tokens']} tokens; no request asks for more than {MAX_TOKENS}"
    if outcome.problem is None and extra:
        outcome.problem = f"{extra} more responses after its end"
    return outcome


def drain(responses: queue.SimpleQueue) -> int:
    """How many items are left in the queue (taken out)."""
    n = 0
    while not responses.empty():
        responses.get()
        n += 1
    return n


def send(client: grpcclient.InferenceServerClient, request: FuzzRequest, request_id: str,
         timeout_s: float) -> Outcome:
    """One request on a stream of its own; its outcome, judged."""
    start = time.monotonic()
    try:
        inputs = [infer_input(t) for t in request.tensors]
    except Exception as e:  # noqa: BLE001 - a request the client library cannot build: the generator's fault
        return Outcome("NOT_SENT", str(e), problem=f"not sent: {type(e).__name__}: {e}")
    responses: queue.SimpleQueue = queue.SimpleQueue()
    counts: Counter = Counter()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    ended = False
    try:
        outputs = [grpcclient.InferRequestedOutput(name) for name in request.outputs]
        client.async_stream_infer(request.model, inputs, outputs=outputs, request_id=request_id,
                                  enable_empty_final_response=True)
        outcome = read_until_end(responses, timeout_s, counts) or Outcome("OK")
        ended = outcome.status != "TIMEOUT"
    finally:
        client.stop_stream(cancel_requests=not ended)  # waits for the server to close the stream
    outcome.tokens, outcome.seconds = counts["tokens"], round(time.monotonic() - start, 3)
    return judge(outcome, request, counts, drain(responses))


def fuzz_worker(url: str, work: queue.SimpleQueue, results: list, lock: threading.Lock, timeout_s: float,
                stop: threading.Event) -> None:
    """Send requests from `work` ((index, request)) until it is empty or `stop` is set."""
    client = grpcclient.InferenceServerClient(url)
    try:
        while not stop.is_set():
            try:
                index, request = work.get_nowait()
            except queue.Empty:
                return
            try:
                outcome = send(client, request, f"fuzz-{index}", timeout_s)
            except Exception as e:  # noqa: BLE001 - e.g. the connection lost: a failure of this request
                outcome = Outcome("CLIENT_ERROR", str(e), problem=f"{type(e).__name__}: {e}")
            with lock:
                results.append((index, request, outcome))
    finally:
        client.close()


# ---- the greedy streams, readiness, the server -------------------------------------------------


def greedy_answer(url: str, model: str, prompt: str, timeout_s: float) -> str:
    deltas = grpc_stream(url, model, prompt, timeout_s=timeout_s, trtllm_format=model.startswith("ensemble_"),
                         max_tokens=GREEDY_MAX_TOKENS, temperature=0.0, apply_chat_template=True)
    return collect(deltas).text


def greedy_models(variants: tuple[str, ...], streams: int) -> list[str]:
    """The model each greedy stream calls: llm and ensemble in turn, over the variants."""
    models = [f"{family}_{v}" for v in variants for family in FAMILIES]
    return [models[i % len(models)] for i in range(streams)]


def references(url: str, models: Iterable[str], timeout_s: float) -> dict[str, dict[str, str]]:
    """The first answer of each model to each greedy prompt."""
    return {m: {p: greedy_answer(url, m, p, timeout_s) for p in GREEDY_PROMPTS} for m in sorted(set(models))}


def greedy_worker(url: str, model: str, expected: dict[str, str], offset: int, timeout_s: float,
                  stop: threading.Event, report: dict) -> None:
    """Repeat the greedy prompts on `model` until `stop`; count the answers, record any that differ."""
    n = offset
    while not stop.is_set():
        prompt = GREEDY_PROMPTS[n % len(GREEDY_PROMPTS)]
        n += 1
        try:
            text = greedy_answer(url, model, prompt, timeout_s)
        except (GenerateError, TimeoutError, InferenceServerException, OSError) as e:
            report["failures"].append({"model": model, "prompt": prompt, "error": f"{type(e).__name__}: {e}"})
            stop.wait(1.0)  # a server gone must not fill the report
            continue
        report["answers"] += 1
        if text != expected[prompt]:
            report["failures"].append({"model": model, "prompt": prompt, "expected": expected[prompt],
                                       "got": text})


def check_ready(client: grpcclient.InferenceServerClient, models: list[str], report: dict) -> None:
    """Ask for the server's liveness and each model's readiness once; record every no."""
    report["checks"] += 1
    for model in models:
        try:
            ready, why = client.is_server_live() and client.is_model_ready(model), "not ready"
        except InferenceServerException as e:
            ready, why = False, str(e)
        if not ready:
            seconds = round(time.monotonic() - report["start"], 1)
            report["not_ready"].append({"s": seconds, "model": model, "why": why[:200]})


def readiness_monitor(url: str, models: list[str], stop: threading.Event, report: dict,
                      interval_s: float = 0.5) -> None:
    """`check_ready` every `interval_s` until `stop`, and once more then."""
    client = grpcclient.InferenceServerClient(url)
    try:
        while not stop.wait(interval_s):
            check_ready(client, models, report)
        check_ready(client, models, report)
    finally:
        client.close()


def process_start_time(pid: int) -> str | None:
    """A running process's start time (field 22 of /proc/<pid>/stat; another process reusing the
    pid has another); None once it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def log_alarms(log: Path, offset: int) -> list[str]:
    """The lines the log gained after `offset` that tell of a crash or a Python traceback."""
    with open(log, "rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", errors="replace")
    return [line[:300] for line in text.splitlines() if any(a in line for a in LOG_ALARMS)][:50]


@dataclass
class ServerWatch:
    """What tells whether tritonserver restarted or crashed: its pid and its log (either may be None)."""

    pid: int | None = None
    log: Path | None = None
    start_time: str | None = None
    log_offset: int = 0

    def begin(self) -> None:
        self.start_time = process_start_time(self.pid) if self.pid else None
        self.log_offset = self.log.stat().st_size if self.log and self.log.is_file() else 0

    def findings(self) -> dict[str, Any]:
        found: dict[str, Any] = {"pid": self.pid, "log": str(self.log) if self.log else None}
        if self.pid:
            now = process_start_time(self.pid)
            found["same_process"] = self.start_time is not None and now == self.start_time
        if self.log and self.log.is_file():
            found["log_alarms"] = log_alarms(self.log, self.log_offset)
        return found

    @staticmethod
    def failed(found: dict[str, Any]) -> bool:
        return found.get("same_process") is False or bool(found.get("log_alarms"))
