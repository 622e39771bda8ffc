"""The request fuzz (`specserve_client.fuzz`) run short against a real tritonserver serving `none`.

150 malformed and edge-case requests to `llm_none` and `ensemble_none`, beside 4 greedy streams:
no request may end with an internal or unrecognized error, hang or answer more tokens than it asked
for; the greedy answers must not change; the models must stay ready; tritonserver must keep running
and log no crash or traceback. `make fuzz` runs the same with 2,000 requests. Also: the fuzz's copy
of the request contract equals the server's, and its reading of error messages follows the server's.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from specserve.config import SamplingParams
from specserve.serving import contract, parsing, repository
from specserve.serving.server import TritonProcess
from specserve_client import fuzz

pytestmark = pytest.mark.e2e

REQUESTS = 150


@pytest.fixture(scope="module")
def e2e(e2e):
    """The shared e2e server, with only the `none` variant loaded."""
    return dataclasses.replace(e2e, variants=("none",))


def test_the_fuzz_copies_the_server_contract(smollm2_dir: Path):
    assert fuzz.CONTRACT_INPUTS == contract.CONTRACT_INPUTS
    assert fuzz.INTERNAL_INPUTS == contract.INTERNAL_INPUTS
    assert fuzz.OUTPUTS == tuple(contract.OUTPUTS)
    assert fuzz.VARIABLE_LENGTH == repository.VARIABLE_LENGTH & set(fuzz.INPUTS)
    # every key and field the server reads is fuzzed (the fuzz may try more)
    assert set(parsing._JSON_FIELDS) <= set(fuzz.SAMPLING_KEYS)
    assert set(parsing._JSON_DEFAULT_ONLY) <= set(fuzz.DEFAULT_ONLY_KEYS)
    assert {f.name for f in dataclasses.fields(SamplingParams)} <= set(fuzz.PARAMS_BASE)
    assert json.loads((smollm2_dir / "config.json").read_text())["vocab_size"] == fuzz.VOCAB_SIZE


CLASSIFIED = [
    ("max_tokens: must be a positive integer, got 0", "INVALID_ARGUMENT"),
    ("in ensemble 'ensemble_none', sampling_parameters.a:b: unknown parameter", "INVALID_ARGUMENT"),
    ("request_config: malformed (KeyError: 'params')", "INVALID_ARGUMENT"),
    ("max_queue_size: 16 requests are already waiting for a slot; retry later", "UNAVAILABLE"),
    ("internal error: TypeError: 'float' object cannot be interpreted as an integer", "INTERNAL"),
    ("engine error", "INTERNAL"),
    ("[request id: f-1] inference input 'seed' data-type is 'INT8', but model 'llm_none' expects 'UINT64'",
     "TRITON_REFUSED"),
    ("Request for unknown model: 'llm_x' is not found", "UNRECOGNIZED"),
    ("probability tensor contains either `inf`, `nan` or element < 0", "UNRECOGNIZED"),
]


@pytest.mark.parametrize(("message", "status"), CLASSIFIED)
def test_error_messages_are_read_as_the_server_writes_them(message, status):
    assert fuzz.classify(message) == status


def _as_text(requests: list[fuzz.FuzzRequest]) -> list[str]:
    """The requests as JSON text (NaN reads back as NaN, not as an equal float)."""
    return [json.dumps(fuzz.request_to_json(r)) for r in requests]


def test_the_drawn_requests_repeat_and_read_back():
    first = _as_text(fuzz.generate(200, 7, ("none",)))
    assert first == _as_text(fuzz.generate(200, 7, ("none",)))
    assert first == _as_text([fuzz.request_from_json(json.loads(text)) for text in first])


def test_malformed_requests_end_cleanly_beside_unchanged_greedy_streams(server: TritonProcess,
                                                                         tmp_path: Path):
    assert server.proc is not None
    config = fuzz.FuzzConfig(requests=REQUESTS, seed=1, variants=("none",), concurrency=6, timeout_s=120.0)
    start = time.monotonic()
    summary = fuzz.run(server.grpc_url, config, fuzz.ServerWatch(server.proc.pid, server.log))
    (tmp_path / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"fuzz: {REQUESTS} requests in {time.monotonic() - start:.0f} s; {summary['by_status']}")
    assert summary["sent"] == REQUESTS
    assert set(summary["by_kind"]) == set(fuzz.KINDS)  # every category was drawn
    assert all(stream["answers"] > 0 for stream in summary["greedy"]["streams"])
    assert summary["readiness"]["checks"] > 0
    shown = {k: summary[k] for k in ("failure_problems", "failures", "greedy", "readiness", "server")}
    assert summary["passed"], json.dumps(shown, indent=1)[:20_000]
