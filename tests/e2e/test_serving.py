"""End-to-end: a real tritonserver serving llm_none, llm_ngram, llm_eagle, llm_eagle3, llm_mtp and llm_standalone
(and their ensembles ensemble_<variant>), driven by real clients."""

from __future__ import annotations

import json
import queue
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from serving_helpers import (
    TIMEOUT_S,
    decode_pace,
    finished,
    metric,
    quick_request_works,
    reference,
    slot_filling_streams,
    start_long_stream,
    wait_for,
)

from specserve.config import SamplingParams
from specserve.engine.outputs import FINISH_REASONS
from specserve_client.stream import (
    OUTPUTS,
    GenerateError,
    collect,
    grpc_inputs,
    grpc_stream,
    grpc_stream_inputs,
    http_generate,
    http_generate_stream,
    http_stream_inputs,
)

pytestmark = pytest.mark.e2e

PROMPT = "What is the capital of France? Answer in one sentence."


# ---- happy paths ----------------------------------------------------------------------------


def test_grpc_stream(server, tokenizer, reference_engine):
    ids = tokenizer.encode(PROMPT, True)
    ref = reference(reference_engine, [ids], 24)[0]
    deltas = list(grpc_stream(server.grpc_url, "llm_none", PROMPT, max_tokens=24, apply_chat_template=True,
                              timeout_s=TIMEOUT_S))
    assert len(deltas) > 1, "a stream of deltas, not one response"
    assert all(d.finish_reason is None for d in deltas[:-1])
    last = deltas[-1]
    assert last.finish_reason == ref.finish_reason
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids
    assert "".join(d.text for d in deltas) == ref.text
    assert last.stats["num_input_tokens"] == len(ids)
    assert all(d.stats["num_output_tokens"] == len(d.token_ids) for d in deltas)  # per response, as vLLM's backend
    assert last.stats["total_draft_tokens"] == 0 and last.stats["accept_length"] == 1.0


def test_grpc_stream_false_sends_one_response(server):
    streamed = collect(grpc_stream(server.grpc_url, "llm_none", PROMPT, max_tokens=12, apply_chat_template=True,
                                   timeout_s=TIMEOUT_S))
    single = collect(grpc_stream(server.grpc_url, "llm_none", PROMPT, max_tokens=12, apply_chat_template=True,
                                 stream=False, timeout_s=TIMEOUT_S))
    assert single.num_responses == 1  # + a flag-only FINAL, which ends the generator
    assert ((single.text, single.token_ids, single.finish_reason)
            == (streamed.text, streamed.token_ids, streamed.finish_reason))


def test_http_generate(server):
    streamed = collect(grpc_stream(server.grpc_url, "llm_none", PROMPT, max_tokens=12, apply_chat_template=True,
                                   timeout_s=TIMEOUT_S))
    # Triton fails /generate on >1 response
    g = http_generate(server.http_url, "llm_none", PROMPT, max_tokens=12, apply_chat_template=True)
    assert (g.text, g.token_ids, g.finish_reason) == (streamed.text, streamed.token_ids, streamed.finish_reason)
    assert g.stats["num_output_tokens"] == len(g.token_ids)
    echoed = http_generate(server.http_url, "llm_none", PROMPT, max_tokens=12, apply_chat_template=True,
                           exclude_input_in_output=False)
    assert echoed.text == PROMPT + streamed.text


def test_http_generate_stream(server):
    streamed = collect(grpc_stream(server.grpc_url, "llm_none", PROMPT, max_tokens=12, apply_chat_template=True,
                                   timeout_s=TIMEOUT_S))
    sse = collect(http_generate_stream(server.http_url, "llm_none", PROMPT, max_tokens=12, apply_chat_template=True))
    assert sse.num_responses > 1
    assert (sse.text, sse.token_ids, sse.finish_reason) == (streamed.text, streamed.token_ids, streamed.finish_reason)


def test_ensemble_takes_the_trtllm_format(server):
    """ensemble_none (preprocessing -> llm_none) takes TensorRT-LLM's [1, 1] tensors and answers as
    llm_none does; llm_none takes vLLM's [1] tensors, and each refuses the other's shapes."""
    direct = collect(grpc_stream(server.grpc_url, "llm_none", PROMPT, max_tokens=10, apply_chat_template=True,
                                 timeout_s=TIMEOUT_S))
    via_ensemble = collect(grpc_stream(server.grpc_url, "ensemble_none", PROMPT, max_tokens=10,
                                       apply_chat_template=True, trtllm_format=True, timeout_s=TIMEOUT_S))
    assert (via_ensemble.text, via_ensemble.token_ids) == (direct.text, direct.token_ids)
    assert via_ensemble.stats["num_input_tokens"] == direct.stats["num_input_tokens"]
    with pytest.raises(GenerateError, match="shape"):
        collect(grpc_stream(server.grpc_url, "ensemble_none", PROMPT, max_tokens=2, timeout_s=TIMEOUT_S))
    with pytest.raises(GenerateError, match="shape"):
        collect(grpc_stream(server.grpc_url, "llm_none", PROMPT, max_tokens=2, trtllm_format=True, timeout_s=TIMEOUT_S))


def test_openai_frontend_trtllm_request_through_the_ensemble(server):
    """The request Triton's OpenAI frontend builds for an ensemble or Python model by default (server
    repo at 0019b9d, python/openai/openai_frontend/engine/utils/triton.py, `_create_trtllm_generate_request`):
    every tensor [1, 1], `stop_words` [1, k], the penalties as tensors, no `apply_chat_template`
    (the frontend renders the chat itself), read back as one string per response."""
    import json

    chat = "<|im_start|>user\n" + PROMPT + "<|im_end|>\n<|im_start|>assistant\n"
    values = {"text_input": [[chat]], "stream": [[True]], "max_tokens": [[12]], "stop_words": [["\n\n", "Paris"]],
              "top_p": [[1.0]], "frequency_penalty": [[0.0]], "presence_penalty": [[0.0]], "seed": [[5]],
              "temperature": [[0.0]]}
    types = {"text_input": ("BYTES", np.object_), "stream": ("BOOL", np.bool_), "max_tokens": ("INT32", np.int32),
             "stop_words": ("BYTES", np.object_), "seed": ("UINT64", np.uint64)}
    inputs = []
    for name, value in values.items():
        dtype, np_type = types.get(name, ("FP32", np.float32))
        arr = np.array([[v.encode() if isinstance(v, str) else v for v in row] for row in value], dtype=np_type)
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    assert inputs[0].shape() == [1, 1] and inputs[3].shape() == [1, 2]
    via_ensemble = collect(grpc_stream_inputs(server.grpc_url, "ensemble_none", inputs, TIMEOUT_S))
    direct = collect(grpc_stream(server.grpc_url, "llm_none", chat, timeout_s=TIMEOUT_S, max_tokens=12,
                                 sampling_parameters=json.dumps({"stop": ["\n\n", "Paris"]})))
    assert (via_ensemble.text, via_ensemble.token_ids, via_ensemble.finish_reason) == (
        direct.text, direct.token_ids, direct.finish_reason)
    assert via_ensemble.text and "Paris" not in via_ensemble.text


def test_vllm_style_payload_with_string_values(server):
    g = collect(grpc_stream(
        server.grpc_url, "llm_none", PROMPT, timeout_s=TIMEOUT_S, exclude_input_in_output=True,
        apply_chat_template=True,
        sampling_parameters='{"max_tokens": "6", "min_tokens": "6", "ignore_eos": "true"}',
    ))  # what genai-perf sends with --streaming and fixed output lengths
    assert len(g.token_ids) == 6 and g.finish_reason == "length"


def test_openai_frontend_vllm_request_gets_usage_and_logprobs(server, tokenizer, reference_engine):
    """The request Triton's OpenAI frontend builds with `--backend vllm` (server repo,
    python/openai/openai_frontend/engine/utils/triton.py, `_create_vllm_generate_request`), with
    logprobs asked for and penalties on: per-response token counts that sum to the output, vLLM's
    logprobs JSON for every token, the output the in-process engine gives with the same penalties."""
    import json

    sampling = {"frequency_penalty": 0.4, "presence_penalty": 0.2, "n": 1, "temperature": 0.0, "top_p": 1.0,
                "max_tokens": 12, "logprobs": 2}
    values = {"text_input": PROMPT, "apply_chat_template": True, "stream": True, "exclude_input_in_output": True,
              "sampling_parameters": json.dumps(sampling), "return_logprobs": True,
              "return_num_input_tokens": True, "return_num_output_tokens": True}
    results: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    names = ["output_ids", "num_input_tokens", "num_output_tokens", "logprobs", "cumulative_logprob", "finish_reason"]
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("llm_none", grpc_inputs(values),
                                  outputs=[grpcclient.InferRequestedOutput(n) for n in names])
        responses = []
        while not responses or not responses[-1]["finish_reason"][0]:
            result, error = results.get(timeout=TIMEOUT_S)
            assert error is None, error
            responses.append({n: result.as_numpy(n) for n in names})
    finally:
        client.stop_stream()
        client.close()
    ids = [int(t) for r in responses for t in r["output_ids"]]
    assert sum(int(r["num_output_tokens"][0]) for r in responses) == len(ids)
    assert all(int(r["num_output_tokens"][0]) == len(r["output_ids"]) for r in responses)
    logprobs = [entry for r in responses for entry in json.loads(r["logprobs"][0])]
    assert len(logprobs) == len(ids)
    for token, entry in zip(ids, logprobs):
        assert entry[str(token)]["rank"] == 1 and entry[str(token)]["logprob"] <= 0.0  # greedy: the top token
        assert 2 <= len(entry) <= 3 and all("decoded_token" in v for v in entry.values())
    cumulative = float(responses[-1]["cumulative_logprob"][0])
    assert cumulative == pytest.approx(sum(e[str(t)]["logprob"] for t, e in zip(ids, logprobs)), abs=1e-3)
    params = SamplingParams(max_tokens=12, frequency_penalty=0.4, presence_penalty=0.2)
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(reference_engine.generate, [tokenizer.encode(PROMPT, True)], params).result()[0]
    assert ids == ref.token_ids


# ---- bad input: an error naming the field, then FINAL; the server keeps serving ------------

BAD_INPUTS = [
    ({"max_tokens": 4}, "text_input"),
    ({"text_input": ""}, "text_input"),
    ({"text_input": "hello " * 1000}, "text_input"),  # longer than the (512-token) context
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": 100_000}, "max_tokens"),
    ({"text_input": "hi", "temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "top_p": 1.5}, "top_p"),
    ({"text_input": "hi", "top_p": 0.0}, "top_p"),
    ({"text_input": "hi", "sampling_parameters": '{"max_tokens": '}, "sampling_parameters"),
    ({"text_input": "hi", "sampling_parameters": '{"temperature": "-0.5"}'}, "temperature"),
    ({"text_input": "hi", "sampling_parameters": '{"max_tokens": "lots"}'}, "sampling_parameters.max_tokens"),
    ({"text_input": "hi", "stream": True, "exclude_input_in_output": False}, "exclude_input_in_output"),
]


@pytest.mark.parametrize(("values", "field"), BAD_INPUTS, ids=[f for _, f in BAD_INPUTS])
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bad_input_is_rejected_naming_the_field(server, protocol, values, field):
    if protocol == "grpc":
        deltas = grpc_stream_inputs(server.grpc_url, "llm_none", grpc_inputs(values), TIMEOUT_S)
    else:
        deltas = http_stream_inputs(server.http_url, "llm_none", {"stream": True, **values}, TIMEOUT_S)
    with pytest.raises(GenerateError, match=rf"\b{re.escape(field)}:"):
        list(deltas)  # the stream ends: an error arrived and nothing hangs
    quick_request_works(server)


def test_wrong_input_type_names_the_field(server):
    wrong = grpcclient.InferInput("max_tokens", [1], "FP32")
    wrong.set_data_from_numpy(np.array([4.0], dtype=np.float32))
    with pytest.raises(GenerateError, match="max_tokens"):
        list(grpc_stream_inputs(server.grpc_url, "llm_none", [*grpc_inputs({"text_input": "hi"}), wrong], TIMEOUT_S))


def test_decoupled_model_errors_end_with_final(server):
    """Errors raised by the decoupled model itself (not preprocessing) must also end the stream; the stream
    stays usable for the next request."""
    results: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    outputs = [grpcclient.InferRequestedOutput(n) for n in OUTPUTS]
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("llm_none", grpc_inputs({"text_input": "hi", "max_tokens": 0}), outputs=outputs)
        _, error = results.get(timeout=TIMEOUT_S)
        assert error is not None and "max_tokens:" in error.message()
        time.sleep(0.5)
        assert results.empty(), "nothing may follow the error"
        client.async_stream_infer(
            "llm_none", grpc_inputs({"text_input": "hi", "max_tokens": 2}), outputs=outputs,
            enable_empty_final_response=True,
        )
        while True:
            result, error = results.get(timeout=TIMEOUT_S)
            assert error is None
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()


# ---- cancellation, metrics, concurrency -----------------------------------------------------


def test_cancellation_frees_the_slots(server, e2e):
    """stop_stream(cancel_requests=True) aborts the decoupled model's requests at its next step: their slots free."""
    before = {reason: finished(server, reason) for reason in FINISH_REASONS}
    streams = slot_filling_streams(server, e2e)
    try:
        for _, results in streams:  # every slot is busy decoding a long request
            assert results.get(timeout=TIMEOUT_S)[1] is None
        steps_per_s, most_steps = decode_pace([results for _, results in streams])
        assert metric(server, "specserve:num_requests_running", model="llm_none") == e2e.slots
        assert metric(server, "specserve:kv_slots_used", model="llm_none") == e2e.slots
    finally:
        for client, _ in streams:
            client.stop_stream(cancel_requests=True)
            client.close()
    busy_s = (e2e.long_request_tokens - most_steps) / steps_per_s  # till the first of them would have ended
    start = time.perf_counter()
    g = collect(grpc_stream(server.grpc_url, "llm_none", "Hi", max_tokens=4, timeout_s=TIMEOUT_S))
    waited = time.perf_counter() - start
    assert len(g.token_ids) >= 1
    assert waited < busy_s / 2, f"the next request waited {waited:.1f}s of {busy_s:.1f}s: cancelled requests hold slots"
    aborted = wait_for(lambda: finished(server, "abort") - before["abort"] >= e2e.slots, 10)
    ended = {reason: finished(server, reason) - before[reason] for reason in FINISH_REASONS}
    assert aborted and ended["abort"] == e2e.slots, f"how the requests since the cancellations ended: {ended}"


def test_a_full_queue_answers_unavailable_and_the_server_keeps_serving(server, e2e):
    """Every slot busy and max_queue_size requests waiting: the next request gets UNAVAILABLE at
    once, naming the limit; once they are cancelled, requests run again and the gauges read 0."""
    streams = slot_filling_streams(server, e2e)
    try:
        for _, results in streams:
            assert results.get(timeout=TIMEOUT_S)[1] is None  # decoding
        streams += [start_long_stream(server.grpc_url, "llm_none", "Hi", 8) for _ in range(e2e.max_queue_size)]
        assert wait_for(lambda: metric(server, "specserve:num_requests_waiting", model="llm_none")
                         == e2e.max_queue_size, 10)
        start = time.perf_counter()
        with pytest.raises(GenerateError, match="max_queue_size"):
            collect(grpc_stream(server.grpc_url, "llm_none", "Hi", max_tokens=4, timeout_s=TIMEOUT_S))
        # refused at once (the UNAVAILABLE code: tests/unit/test_triton_model.py)
        assert time.perf_counter() - start < 5.0
    finally:
        for client, _ in streams:
            client.stop_stream(cancel_requests=True)
            client.close()
    # the cancelled requests, queued ones included, leave within a few engine steps
    for gauge in ("num_requests_waiting", "num_requests_running", "kv_slots_used"):
        assert wait_for(lambda g=gauge: metric(server, f"specserve:{g}", model="llm_none") == 0, 10), gauge
    quick_request_works(server)


def test_closing_an_http_stream_cancels_it(server, e2e):
    aborted_before = finished(server, "abort")
    deltas = http_generate_stream(server.http_url, "llm_none", "Count to 1000.", max_tokens=e2e.long_request_tokens,
                                  ignore_eos=True)
    next(deltas)
    deltas.close()  # closes the connection
    assert wait_for(lambda: finished(server, "abort") > aborted_before, 15), "closing the SSE stream did not abort"


@pytest.mark.xfail(
    strict=True,
    reason="Triton (2.51 and current core) checks an ensemble's cancellation only between steps, so a "
    "decoupled step already streaming never sees it; llm_<variant>, what clients call, gets it (the tests above)",
)
def test_cancelling_an_ensemble_stream_reaches_the_engine(server):
    aborted_before, length_before = finished(server, "abort"), finished(server, "length")
    client, results = start_long_stream(server.grpc_url, "ensemble_none", "Count to 1000.", 40, trtllm_format=True)
    try:
        results.get(timeout=TIMEOUT_S)
        client.stop_stream(cancel_requests=True)
        assert wait_for(lambda: finished(server, "abort") > aborted_before, 3)
    finally:
        client.close()
        # the uncancelled request runs to max_tokens: let it finish before the next test
        wait_for(lambda: finished(server, "abort") + finished(server, "length") > aborted_before + length_before, 60)


def test_a_short_soak_of_every_request_kind_passes(server):
    """`make soak`'s checks over 20 seconds: plain and ensemble streams, streams cancelled after
    their first token and bad requests mixed on 4 workers; every response carries its request's id,
    one FINAL each, bad requests end in an error, every cancellation aborted in the engine, the
    gauges back to 0 (the workers' draws are seeded: every kind comes up)."""
    from specserve_client import soak

    report = soak.soak(server.grpc_url, server.metrics_url, server.proc.pid, "none", minutes=1 / 3, concurrency=4,
                       sample_s=5.0)
    assert report["passed"], {k: v for k, v in report.items() if k != "memory_samples"}
    assert {key.split(":")[0] for key in report["outcomes"]} == set(soak.KIND_WEIGHTS)


def test_metrics_are_exported(server):
    quick_request_works(server)
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    for family in (
        "specserve:time_to_first_token_seconds_bucket",
        "specserve:time_per_output_token_seconds_bucket",
        "specserve:e2e_request_latency_seconds_bucket",
        "specserve:spec_decode_accept_length_bucket",
        "specserve:spec_decode_tree_size_bucket",
        "specserve:prompt_tokens_total",
        "specserve:generation_tokens_total",
        "specserve:spec_decode_num_draft_tokens_total",
        "specserve:spec_decode_num_accepted_tokens_total",
        "specserve:request_finished_total",
        "specserve:num_requests_waiting",
        "specserve:num_requests_running",
        "specserve:kv_slots_used",
    ):
        assert f'{family}{{' in text, family
    assert metric(server, "specserve:generation_tokens_total", model="llm_none", version="1") > 0
    assert metric(server, "specserve:time_to_first_token_seconds_count", model="llm_none") > 0
    assert metric(server, "specserve:spec_decode_tree_size_count", model="llm_none") > 0  # size 1 per step


def test_concurrent_streams_each_get_their_own_tokens(server, tokenizer, reference_engine, mtbench_prompts):
    prompts = mtbench_prompts[:16]
    ids = [tokenizer.encode(p, True) for p in prompts]
    refs = reference(reference_engine, ids, 16)
    barrier = threading.Barrier(len(prompts))

    def client(prompt: str):
        barrier.wait()  # 16 requests at once on 4 slots: 12 must queue, none dropped
        return collect(grpc_stream(server.grpc_url, "llm_none", prompt, max_tokens=16, apply_chat_template=True,
                                   timeout_s=TIMEOUT_S))

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(client, prompts))
    for i, (got, ref) in enumerate(zip(results, refs)):
        assert got.token_ids == ref.token_ids, f"client {i} got someone else's (or wrong) tokens"
        assert got.text == ref.text
        assert got.stats["num_input_tokens"] == len(ids[i])


def test_ngram_variant_is_lossless_and_drafts(server, e2e, tokenizer, reference_engine):
    assert "ngram" in e2e.variants
    prompt = "Repeat this list twice: red, green, blue, yellow, red, green, blue, yellow."
    ids = tokenizer.encode(prompt, True)
    ref = reference(reference_engine, [ids], 32)[0]
    g = collect(grpc_stream(server.grpc_url, "llm_ngram", prompt, max_tokens=32, apply_chat_template=True,
                            timeout_s=TIMEOUT_S))
    assert g.token_ids == ref.token_ids and g.text == ref.text
    assert g.stats["total_draft_tokens"] > 0
    assert metric(server, "specserve:spec_decode_num_draft_tokens_total", model="llm_ngram") > 0


@pytest.mark.parametrize("variant", ["suffix", "hybrid"])
def test_variants_that_learn_draft_from_earlier_requests_and_end_only_their_own(server, e2e, tokenizer,
                                                                             reference_engine, variant):
    """llm_suffix and llm_hybrid: a request's text drafts for the next one of its cache salt (same
    greedy tokens as plain decoding, more accepted the second time), not for another salt's; bad
    input and a cancelled stream end only their own request."""
    assert variant in e2e.variants
    prompt = "List the planets of the solar system in order, one per line."
    ref = reference(reference_engine, [tokenizer.encode(prompt, True)], 48)[0]

    def ask(salt: str) -> object:
        params = json.dumps({"cache_salt": salt})
        g = collect(grpc_stream(server.grpc_url, f"llm_{variant}", prompt, max_tokens=48, apply_chat_template=True,
                                sampling_parameters=params, timeout_s=TIMEOUT_S))
        assert g.token_ids == ref.token_ids and g.text == ref.text
        return g

    first, second, other = ask("tenant-a"), ask("tenant-a"), ask("tenant-b")
    accepted = [g.stats["total_accepted_draft_tokens"] for g in (first, second, other)]
    assert accepted[1] > accepted[0] and accepted[2] < accepted[1]
    assert metric(server, "specserve:spec_decode_num_accepted_tokens_total", model=f"llm_{variant}") > 0
    with pytest.raises(GenerateError, match=r"\btop_p:"):
        list(grpc_stream_inputs(server.grpc_url, f"llm_{variant}", grpc_inputs({"text_input": "hi", "top_p": 1.5}),
                                TIMEOUT_S))
    client, results = start_long_stream(server.grpc_url, f"llm_{variant}", "Count from 1 to 1000.", 256)
    try:
        assert results.get(timeout=TIMEOUT_S)[1] is None
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert ask("tenant-a").token_ids == ref.token_ids


@pytest.mark.parametrize("variant", ["eagle", "eagle3", "mtp", "standalone"])
def test_model_drafter_variants_are_lossless_and_accept(server, e2e, tokenizer, reference_engine, variant):
    """The ensembles with the committed SmolLM2 drafters (and the self-speculative standalone
    draft): same greedy text as the base engine, over HTTP generate_stream, with drafts accepted
    (counted by Triton's metrics too)."""
    assert variant in e2e.variants
    prompt = "Write three short sentences about the ocean."
    ref = reference(reference_engine, [tokenizer.encode(prompt, True)], 32)[0]
    g = collect(http_generate_stream(server.http_url, f"llm_{variant}", prompt, max_tokens=32, apply_chat_template=True,
                                     timeout_s=TIMEOUT_S))
    assert g.token_ids == ref.token_ids and g.text == ref.text
    assert g.stats["total_draft_tokens"] > 0
    assert metric(server, "specserve:spec_decode_num_accepted_tokens_total", model=f"llm_{variant}") > 0


# ---- structured outputs -------------------------------------------------------------------------

ORDER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["item", "quantity", "express"],
                "properties": {"item": {"type": "string", "maxLength": 20},
                               "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                               "express": {"type": "boolean"}}}
ORDER_PROMPT = "I'd like three blue mugs, shipped express please. Answer in JSON."


@pytest.mark.parametrize("variant", ["ngram", "eagle3"])
def test_structured_outputs_in_both_backends_forms(server, tokenizer, reference_engine, variant):
    """vLLM's `structured_outputs` to llm_<variant> and TensorRT-LLM's guided-decoding tensors to
    ensemble_<variant>: the same greedy JSON, valid against its schema, as the in-process engine's
    plain decoding under the schema."""
    import jsonschema

    from specserve.grammar import GrammarSpec

    sampling = json.dumps({"structured_outputs": {"json": ORDER_SCHEMA}})
    direct = collect(grpc_stream(server.grpc_url, f"llm_{variant}", ORDER_PROMPT, max_tokens=64,
                                 apply_chat_template=True, sampling_parameters=sampling, timeout_s=TIMEOUT_S))
    ensemble = collect(grpc_stream(server.grpc_url, f"ensemble_{variant}", ORDER_PROMPT, max_tokens=64,
                                   apply_chat_template=True, trtllm_format=True, timeout_s=TIMEOUT_S,
                                   guided_decoding_guide_type="json_schema",
                                   guided_decoding_guide=json.dumps(ORDER_SCHEMA)))
    params = SamplingParams(max_tokens=64, structured_output=GrammarSpec("json_schema", json.dumps(ORDER_SCHEMA)))
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(reference_engine.generate, [tokenizer.encode(ORDER_PROMPT, True)], params).result()[0]
    assert direct.finish_reason == "stop", direct.text
    jsonschema.validate(json.loads(direct.text), ORDER_SCHEMA)
    assert direct.token_ids == ref.token_ids and ensemble.token_ids == ref.token_ids


def test_structured_output_errors_end_only_their_request(server):
    for model, kwargs, error in [
        ("llm_none", {"sampling_parameters": json.dumps({"structured_outputs": {"regex": "(unclosed"}})},
         "structured_output: the regex does not compile"),
        ("llm_none", {"sampling_parameters": json.dumps({"guided_decoding": {"regex": "a", "choice": ["b"]}})},
         "set exactly one of"),
        ("ensemble_none", {"trtllm_format": True, "guided_decoding_guide_type": "lark",
                           "guided_decoding_guide": "start: x"}, "guided_decoding_guide_type: must be one of"),
    ]:
        with pytest.raises(GenerateError, match=re.escape(error)):
            collect(grpc_stream(server.grpc_url, model, PROMPT, max_tokens=8, timeout_s=TIMEOUT_S, **kwargs))
    choice = json.dumps({"structured_outputs": {"choice": ["Paris", "Lyon"]}})
    g = collect(grpc_stream(server.grpc_url, "llm_none", PROMPT, max_tokens=8, apply_chat_template=True,
                            sampling_parameters=choice, timeout_s=TIMEOUT_S))
    assert g.text in ("Paris", "Lyon") and g.finish_reason == "stop"
