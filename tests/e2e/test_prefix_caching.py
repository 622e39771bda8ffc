"""Prefix caching and chunked prefill through a real tritonserver: the client benchmark
(`specserve_client.prefixbench`) run small, and the cached-token counts its responses carry
against the server's Prometheus counters."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from specserve.serving.server import TritonProcess, copy_repository, default_repository, free_port
from specserve_client import prefixbench

pytestmark = pytest.mark.e2e

BUDGET = 64  # max_num_batched_tokens: the long prompt is prefilled over several steps


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path, engine_params: dict[str, str]
           ) -> Iterator[TritonProcess]:
    root = tmp_path_factory.mktemp("triton-prefix")
    params = engine_params | {"max_num_batched_tokens": str(BUDGET)}
    repo = copy_repository(default_repository(), root / "model_repository", {"llm_none": params})
    with TritonProcess(repo, ["llm_none"], free_port(), free_port(), free_port(), log=root / "tritonserver.log") as p:
        yield p


def small_run(server: TritonProcess) -> dict:
    args = prefixbench.parse_args(["--url", server.grpc_url, "--metrics-url", server.metrics_url,
                                   "--conversations", "2", "--turn-tokens", "12", "--system-tokens", "150",
                                   "--shared-requests", "4", "--shared-concurrency", "2", "--streams", "2",
                                   "--long-tokens", "250", "--stream-tokens", "40", "--timeout-s", "300"])
    return prefixbench.run(server.grpc_url, "llm_none", args)


def test_the_benchmark_reports_what_the_cache_saved(server):
    report = small_run(server)
    turns, shared, long = report["multi_turn"], report["shared_system"], report["long_prompt"]
    # a second turn reuses its first turn (prompt + answer) in place; the same prompt cold reuses nothing
    assert all(c >= n // 2 for c, n in zip(turns["turn2"]["num_cached_tokens"], turns["turn2"]["num_input_tokens"]))
    assert max(turns["turn2_cold"]["num_cached_tokens"]) <= 2
    # the shared system prompt is computed once: the later requests find it cached
    assert all(c >= 150 * 0.8 for c in shared["rest"]["num_cached_tokens"])
    # what the responses say is what the server counted: cached, and computed (the rest, no padding)
    for part in (turns, shared, long):
        sent, counted = part["responses"], part["server_counters"]
        assert counted["prompt_tokens_cached_total"] == sent["cached_tokens"], part
        assert counted["prompt_tokens_computed_total"] == sent["prompt_tokens"] - sent["cached_tokens"], part
    # chunked: the streams got responses while the long prompt was prefilled
    assert long["long_prompt_tokens"] > 2 * BUDGET
    assert long["responses_during_prefill"] >= long["streams"]
    assert long["longest_gap_during_prefill_s"] is not None and long["median_gap_s"] > 0


def test_free_slots_hold_cached_tokens_after_requests_end(server):
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    gauge = next(line for line in text.splitlines() if line.startswith("specserve:prefix_cache_tokens{"))
    assert float(gauge.rsplit(" ", 1)[1]) > 0
