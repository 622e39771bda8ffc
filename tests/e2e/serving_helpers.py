"""What the serving tests share: the in-process reference, the server's metrics, long streams to cancel."""

from __future__ import annotations

import queue
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tritonclient.grpc as grpcclient

from specserve.config import SamplingParams
from specserve_client.stream import collect, grpc_inputs, grpc_stream, request_inputs

TIMEOUT_S = 120


def reference(engine, prompt_ids: list[list[int]], max_tokens: int):
    """Greedy outputs of the in-process engine. Run on a worker thread, as the server runs it:
    on a busy 2-core CPU, torch ops from the main thread were several times slower."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(engine.generate, prompt_ids, SamplingParams(max_tokens=max_tokens)).result()


def metric(server, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def quick_request_works(server) -> None:
    g = collect(grpc_stream(server.grpc_url, "llm_none", "Hi", max_tokens=2, timeout_s=TIMEOUT_S))
    assert len(g.token_ids) >= 1 and g.finish_reason in ("stop", "length")


def start_long_stream(url: str, model: str, prompt: str, max_tokens: int, trtllm_format: bool = False):
    results: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    values = request_inputs(prompt, max_tokens=max_tokens, ignore_eos=True)
    client.async_stream_infer(model, grpc_inputs(values, trtllm_format),
                              outputs=[grpcclient.InferRequestedOutput("output_ids")])
    return client, results


def slot_filling_streams(server, e2e) -> list:
    """One long request to `llm_none` a KV slot (see `start_long_stream`)."""
    return [start_long_stream(server.grpc_url, "llm_none", f"Count from {i} to 1000.", e2e.long_request_tokens)
            for i in range(e2e.slots)]


def decode_pace(queues: list[queue.SimpleQueue], pace_s: float = 0.5) -> tuple[float, int]:
    """Streams of `llm_none` (one response a step), each past its first response: after `pace_s`, the
    slowest one's steps a second, and the most steps any of them has taken."""
    time.sleep(pace_s)
    counts = []
    for results in queues:
        n = 1  # the first response, taken
        while not results.empty():
            results.get()
            n += 1
        counts.append(n)
    assert min(counts) > 1, f"a stream got no response in {pace_s} s: {counts}"
    return (min(counts) - 1) / pace_s, max(counts)


def finished(server, reason: str) -> float:
    return metric(server, "specserve:request_finished_total", model="llm_none", finish_reason=reason)


def wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (read from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return found


def descendants(pid: int) -> list[int]:
    """Its children, theirs, and so on."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found
