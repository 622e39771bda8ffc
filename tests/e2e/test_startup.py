"""End-to-end start-up on a CPU: a real tritonserver's llm_eagle3 answers at once with its eager
engine while a process of its own builds the compiled programs, then switches to them at an idle
moment (the log says so), and answers as the engine of its configuration does before and after."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine import precompile
from specserve.engine.engine import Engine
from specserve.serving.server import default_repository
from specserve_client.local_server import LocalServer, local_server
from specserve_client.stream import collect, grpc_stream

pytestmark = pytest.mark.e2e
PROMPT = "What is the capital of France? Answer in one sentence."
TIMEOUT_S = 120
SWITCH_TIMEOUT_S = 900  # from an empty compile cache on a 2-core CPU: minutes
EAGER, SWITCHED = "serving eagerly while its compiled programs build", "switched to its compiled programs"


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory,
            engine_params: dict[str, str]) -> Iterator[tuple[LocalServer, Path]]:
    """llm_eagle3 started as the client's benchmarks start a server (`specserve serve` as a command);
    once the module is done, tritonserver is gone."""
    log = tmp_path_factory.mktemp("triton-startup") / "tritonserver.log"
    # the served default: paths chosen by timings
    params = engine_params | {"serve_while_compiling": "true", "adaptive": "false", "compiled_steps": "auto"}
    with local_server("eagle3", parameters=params, log=log) as server:
        yield server, log
    with pytest.raises(ProcessLookupError):
        os.kill(server.pid, 0)


def greedy(config: EngineConfig, ids: list[int]) -> list[int]:
    """The in-process engine's greedy answer, on a worker thread as a server runs it."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: Engine(config).generate([ids], SamplingParams(max_tokens=24))[0].token_ids).result()


def test_the_model_answers_eagerly_then_switches_to_its_compiled_programs(started, smollm2_dir, tokenizer, e2e):
    served = EngineConfig(
        model_dir=str(smollm2_dir), max_batch_size=e2e.slots, max_seq_len=e2e.max_seq_len, dtype="float32",
        spec=SpecConfig(algorithm="eagle3", drafter_path=str(default_repository() / "llm_eagle3" / "drafter"),
                        adaptive=False))
    served = precompile.with_threads(served)  # as the server runs them: the eager engine on a thread fewer
    ids = tokenizer.encode(PROMPT, True)
    server, log_path = started
    log = log_path.read_text
    first = collect(grpc_stream(server.grpc_url, "llm_eagle3", PROMPT, max_tokens=24, apply_chat_template=True,
                                timeout_s=TIMEOUT_S))
    assert EAGER in log()
    if SWITCHED not in log():  # it answered before the switch: the eager engine did
        assert first.token_ids == greedy(precompile.eager_config(served), ids)
    deadline = time.monotonic() + SWITCH_TIMEOUT_S
    while SWITCHED not in log():
        assert time.monotonic() < deadline, "the model did not switch to its compiled programs"
        time.sleep(1)
    after = collect(grpc_stream(server.grpc_url, "llm_eagle3", PROMPT, max_tokens=24, apply_chat_template=True,
                                timeout_s=TIMEOUT_S))
    assert after.token_ids == greedy(served, ids)
