"""Custom Prometheus metrics of the decoupled model, on Triton's /metrics endpoint.

Named like vLLM's backend (`vllm:time_to_first_token_seconds` ...) under a `specserve:` prefix,
plus what nobody else reports: speculative acceptance (accept length per verify step, draft
tokens proposed / accepted), and prefix caching (prompt tokens reused / computed, tokens cached).
Every series is labelled `model` and `version`.

The Python backend of Triton 2.51 supports `MetricFamily.HISTOGRAM` (`Metric(labels, buckets)`,
`observe`). Where it does not (older backends), a histogram degrades to two counters,
`<name>_sum` and `<name>_count`, so a mean can still be computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import triton_python_backend_utils as pb_utils

from specserve.engine.outputs import FINISH_ERROR, FINISH_REASONS, EngineLoad

PREFIX = "specserve:"

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0]
TPOT_BUCKETS = [0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0]
ACCEPT_LENGTH_BUCKETS = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0, 64.0]
TREE_SIZE_BUCKETS = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0]



def has_histogram() -> bool:
    """Asked at run time: the stub fills in pb_utils.MetricFamily only after importing model.py."""
    return hasattr(pb_utils.MetricFamily, "HISTOGRAM")


class _SummaryCounters:
    """A histogram's stand-in where the backend has none: `<name>_sum` and `<name>_count` counters."""

    _families: dict[str, tuple[Any, Any]] = {}

    def __init__(self, name: str, description: str, labels: dict[str, str]) -> None:
        if name not in self._families:
            self._families[name] = (
                pb_utils.MetricFamily(f"{name}_sum", f"{description} (sum)", pb_utils.MetricFamily.COUNTER),
                pb_utils.MetricFamily(f"{name}_count", f"{description} (count)", pb_utils.MetricFamily.COUNTER),
            )
        sum_family, count_family = self._families[name]
        self._sum = sum_family.Metric(labels=labels)
        self._count = count_family.Metric(labels=labels)

    def observe(self, value: float) -> None:
        self._sum.increment(value)
        self._count.increment(1.0)


@dataclass(frozen=True)
class RequestStats:
    """One finished request, as the metrics see it (times from time.perf_counter)."""

    arrival: float
    first_token: float | None
    finished: float
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int


class ServingMetrics:
    """Families are created once per process; one instance per model instance."""

    def __init__(self, model: str, version: str) -> None:
        labels = {"model": model, "version": version}
        self.histograms = has_histogram()
        self._families: list[Any] = []  # keep them alive as long as their metrics

        def counter(name: str, description: str, **extra: str) -> Any:
            family = pb_utils.MetricFamily(PREFIX + name, description, pb_utils.MetricFamily.COUNTER)
            self._families.append(family)
            return family.Metric(labels={**labels, **extra})

        def histogram(name: str, description: str, buckets: Sequence[float]) -> Any:
            if not self.histograms:
                return _SummaryCounters(PREFIX + name, description, labels)
            family = pb_utils.MetricFamily(PREFIX + name, description, pb_utils.MetricFamily.HISTOGRAM)
            self._families.append(family)
            return family.Metric(labels=labels, buckets=list(buckets))

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from request arrival to its first token, in seconds.", TTFT_BUCKETS
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Mean time per output token after the first, in seconds.", TPOT_BUCKETS
        )
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "Time from request arrival to its last response, in seconds.", E2E_BUCKETS
        )
        self.accept_length = histogram(
            "spec_decode_accept_length",
            "Tokens emitted per verify step (accepted drafts + 1); 1 = no speed-up.",
            ACCEPT_LENGTH_BUCKETS,
        )
        self.tree_size = histogram(
            "spec_decode_tree_size",
            "Draft tree nodes verified per step, root included (1 = the step decoded without a draft): "
            "the shapes adaptive speculation chose.",
            TREE_SIZE_BUCKETS,
        )
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated (streamed) so far.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens_total", "Draft tokens proposed and verified.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens_total", "Draft tokens accepted.")
        def gauge(name: str, description: str) -> Any:
            family = pb_utils.MetricFamily(PREFIX + name, description, pb_utils.MetricFamily.GAUGE)
            self._families.append(family)
            return family.Metric(labels=labels)

        self.requests_waiting = gauge("num_requests_waiting", "Requests queued for a KV slot.")
        self.requests_running = gauge("num_requests_running", "Requests holding a KV slot (decoding).")
        self.kv_slots_used = gauge("kv_slots_used", "KV-cache slots in use.")
        self.prefix_cache_tokens = gauge("prefix_cache_tokens",
                                         "Tokens whose K/V the free KV slots keep for reuse (prefix caching).")
        self.drafter_cache_tokens = gauge("drafter_cache_tokens", "Tokens of finished requests the drafter keeps "
                                          "to draft from (suffix decoding; at most suffix_cache_tokens).")
        self.prompt_tokens_cached = counter("prompt_tokens_cached_total",
                                            "Prompt tokens whose K/V were reused from the prefix cache, not computed.")
        self.prompt_tokens_computed = counter("prompt_tokens_computed_total",
                                              "Prompt positions the target computed (prefill chunks, no padding).")
        self._prompt_totals = (0, 0)  # the engine's (reused, computed) at the last set_load
        family = pb_utils.MetricFamily(
            PREFIX + "request_finished_total", "Finished requests by finish reason.", pb_utils.MetricFamily.COUNTER
        )
        self._families.append(family)
        self.finished = {r: family.Metric(labels={**labels, "finish_reason": r}) for r in FINISH_REASONS}

    def close(self) -> None:
        """Drop every metric and family of this instance now, while the stub still serves: their
        destructors call into the server, which they cannot do from the interpreter's last garbage
        collection, after the stub has freed its shared memory. Nothing is recorded afterwards."""
        vars(self).clear()
        _SummaryCounters._families.clear()

    def on_delta(self, new_tokens: int, new_draft_tokens: int, new_accepted_tokens: int, accept_lengths: Sequence[int],
                 tree_sizes: Sequence[int] = ()) -> None:
        """After each engine delta of any request."""
        if new_tokens:
            self.generation_tokens.increment(float(new_tokens))
        if new_draft_tokens:
            self.draft_tokens.increment(float(new_draft_tokens))
        if new_accepted_tokens:
            self.accepted_tokens.increment(float(new_accepted_tokens))
        for n in accept_lengths:
            self.accept_length.observe(float(n))
        for n in tree_sizes:
            self.tree_size.observe(float(n))

    def set_load(self, load: EngineLoad) -> None:
        """When the engine's load changes (on the model's Triton thread)."""
        self.requests_waiting.set(float(load.waiting))
        self.requests_running.set(float(load.running))
        self.kv_slots_used.set(float(load.kv_slots_used))
        self.prefix_cache_tokens.set(float(load.prefix_cache_tokens))
        self.drafter_cache_tokens.set(float(load.drafter_cache_tokens))
        totals = (load.prompt_tokens_reused, load.prompt_tokens_computed)
        for counter, now, before in zip((self.prompt_tokens_cached, self.prompt_tokens_computed), totals,
                                        self._prompt_totals):
            added = now - before if now >= before else now  # fewer: totals that started again from 0
            if added:
                counter.increment(float(added))
        self._prompt_totals = totals

    def on_finish(self, stats: RequestStats) -> None:
        self.finished.get(stats.finish_reason, self.finished[FINISH_ERROR]).increment(1.0)
        self.prompt_tokens.increment(float(stats.num_prompt_tokens))
        self.e2e_latency.observe(stats.finished - stats.arrival)
        if stats.first_token is not None:
            self.time_to_first_token.observe(stats.first_token - stats.arrival)
            if stats.num_output_tokens > 1:
                tpot = (stats.finished - stats.first_token) / (stats.num_output_tokens - 1)
                self.time_per_output_token.observe(tpot)
