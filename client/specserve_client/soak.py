"""Soak a served variant: minutes of concurrent streams with cancellations and bad requests mixed in.

    python -m specserve_client.soak --variant none --minutes 10 --concurrency 8 --out results/soak

Each worker is one client (one gRPC connection, or with `--connection-per-request` a new one for
every request) and loops until the time is up, drawing per request a stream of its own, of one of
`--kinds` (default all five; one alone, e.g. `--kinds normal`, tells which kind a change in memory
comes with):
  - normal: a stream (greedy, 8-64 tokens) to `llm_<variant>`, or (ensemble) to
    `ensemble_<variant>` in its [1, 1] shapes: every response must carry the request's own id,
    exactly one FINAL must arrive, and the tokens must not exceed max_tokens;
  - cancel: a stream to `llm_<variant>` (256 tokens, ignore_eos) cancelled after its first response;
  - bad: a request with a negative temperature or max_tokens 0: it must end in an error, not hang;
  - turn: the next turn of the worker's own conversation (its earlier prompts and answers, then a
    new question; a new conversation after 6 turns), as a chat client sends it: the prompt's
    prefix is what prefix caching reuses.
With `--prompts FILE` (a JSONL of {"prompt"} lines, e.g. bench/repetitive.jsonl) the normal and
ensemble requests take its prompts in turn, as a workload that repeats itself would send them.
The server runs with `prefix_cache_max_tokens` = `--prefix-cache-max-tokens` (and, with
`--suffix-cache-tokens`, that `suffix_cache_tokens`: the drafter's gauge must stay within it). When the time is up
it waits for the engine to drain and checks that the running / waiting gauges and the KV slots in
use are back to 0. The resident memory of the server's processes (and its anon / file / shmem
parts) and the cached-tokens gauge are sampled every `--sample-s` seconds; the gauge must never
exceed the knob, and the memory must grow less than `--max-rss-growth-mb` after start-up: the
first minute, and the first minute after the model switched to its compiled programs (the log
says when; the switch replaces the eager engine by one with the programs' memory). The growth
after the first minute alone is reported too.
Writes `<out>/soak.json`; exits 1 when a check fails. It starts its own server (free ports): it
does not measure speed.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import re
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import tritonclient.grpc as grpcclient

from specserve_client.local_server import local_server
from specserve_client.prefixbench import chatml
from specserve_client.stream import grpc_inputs, request_inputs
from specserve_client.variants import variant_name

TIMEOUT_S = 120.0
KIND_WEIGHTS = {"normal": 0.36, "ensemble": 0.14, "cancel": 0.15, "bad": 0.15, "turn": 0.20}  # drawn per request
TURNS = 6  # a conversation's turns before the worker starts a new one
SYSTEM = "You are a helpful assistant. Answer in one or two sentences."
CACHED_GAUGE = "specserve:prefix_cache_tokens"
DRAFTER_GAUGE = "specserve:drafter_cache_tokens"
GAUGES = ("specserve:num_requests_running", "specserve:num_requests_waiting", "specserve:kv_slots_used")


def metric(metrics_url: str, name: str, **labels: str) -> float:
    """The sum of a metric over the series whose labels include `labels`."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        if all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def server_processes(root_pid: int) -> dict[str, int]:
    """`root_pid` and each of its descendants (tritonserver and its Python-backend stubs, the stubs
    named by the model directory they serve), as {"<name> (<pid>)": pid}."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    named, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        name = Path(argv[0].decode()).name
        if name == "triton_python_backend_stub" and len(argv) > 1:  # argv[1]: <repository>/<model>/<version>/model.py
            name = f"stub {Path(argv[1].decode()).parent.parent.name}"
        named[f"{name} ({pid})"] = pid
    return named


def resident_mb(pid: int) -> dict[str, float]:
    """A process's resident memory in MB: "rss" and its parts "anon" (heap, stacks), "file"
    (mapped files, e.g. libraries) and "shmem" (shared memory, e.g. the Python backend's regions);
    {} once the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    fields = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    parts = {}
    for words in (line.split() for line in status):
        if words and words[0] in fields:  # "VmRSS: <n> kB"
            parts[fields[words[0]]] = round(int(words[1]) / 1024, 1)
    return parts


def server_memory(root_pid: int) -> dict:
    """One memory sample of the server's processes: "rss_mb" (the sum of tritonserver's and its
    model stubs'; a model's compile process, which ends, is left out), "by_process" (each
    process's resident MB, every descendant's) and "parts" (each one's anon / file / shmem MB)."""
    parts = {name: resident_mb(pid) for name, pid in server_processes(root_pid).items()}
    parts = {name: mb for name, mb in parts.items() if mb}
    by_process = {name: mb.pop("rss") for name, mb in parts.items()}
    serving = [mb for name, mb in by_process.items() if name.startswith(("tritonserver ", "stub "))]
    return {"rss_mb": round(sum(serving), 1), "by_process": by_process, "parts": parts}


def one_request(client: grpcclient.InferenceServerClient, model: str, values: dict, request_id: str,
                cancel_after: int | None, trtllm_format: bool = False, text: list[str] | None = None) -> str:
    """Stream one request on its own gRPC stream of `client`; returns its outcome: "ok",
    "cancelled", "error", or a failure text. A stream that got its FINAL is closed as a client
    that is done closes it (no cancellation); any other is cancelled. With `text`, the streamed
    text is appended to it."""
    responses: queue.SimpleQueue = queue.SimpleQueue()
    finals, tokens, seen = 0, 0, 0
    outputs = ["output_ids"] + (["text_output"] if text is not None else [])
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(model, grpc_inputs(values, trtllm_format), request_id=request_id,
                                  enable_empty_final_response=True,
                                  outputs=[grpcclient.InferRequestedOutput(name) for name in outputs])
        while True:
            try:
                result, error = responses.get(timeout=TIMEOUT_S)
            except queue.Empty:
                return f"no response within {TIMEOUT_S} s"
            if error is not None:
                return "error"
            response = result.get_response()
            if response.id != request_id:
                return f"mixed up: response id {response.id!r} for request {request_id!r}"
            if response.outputs:
                tokens += result.as_numpy("output_ids").size
                if text is not None:
                    text += [t.decode() if isinstance(t, bytes) else str(t)
                             for t in result.as_numpy("text_output").reshape(-1)]
            seen += 1
            if response.parameters["triton_final_response"].bool_param:
                finals += 1
                break
            if cancel_after is not None and seen >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return "cancelled"
        if tokens > values.get("max_tokens", 1 << 30):
            return f"{tokens} tokens for max_tokens {values['max_tokens']}"
        return "ok" if finals == 1 else f"{finals} final responses"
    finally:
        client.stop_stream(cancel_requests=finals == 0)


def worker(url: str, variant: str, deadline: float, seed: int, outcomes: Counter, failures: list, lock: threading.Lock,
           connection_per_request: bool = False, kinds: tuple[str, ...] = tuple(KIND_WEIGHTS),
           prompts: list[str] | None = None) -> None:
    """One client's requests until `deadline`, each on a stream of its own, over one gRPC
    connection (as tritonclient users and perf_analyzer do) or a new one per request. `prompts`:
    what its normal and ensemble requests ask, in turn from the worker's own offset."""
    rng = random.Random(seed)
    n = 0
    history: list[tuple[str, str | None]] = []  # the worker's conversation so far
    client = grpcclient.InferenceServerClient(url)
    while time.monotonic() < deadline:
        n += 1
        request_id = f"w{seed}-{n}"
        kind = rng.choices(kinds, weights=[KIND_WEIGHTS[k] for k in kinds])[0]
        trtllm_format = kind == "ensemble"
        if kind in ("normal", "ensemble"):
            model, cancel_after = f"{'ensemble' if trtllm_format else 'llm'}_{variant}", None
            prompt = (prompts[(seed * 31 + n) % len(prompts)] if prompts
                      else f"Tell me one fact about the number {rng.randint(1, 10_000)}.")
            values = request_inputs(prompt, max_tokens=rng.randint(8, 64), temperature=0.0, apply_chat_template=True)
        elif kind == "turn":
            model, cancel_after = f"llm_{variant}", None
            if len(history) >= TURNS:
                history = []
            history.append((f"And one fact about the number {rng.randint(1, 10_000)}?", None))
            values = request_inputs(chatml(SYSTEM, history), max_tokens=rng.randint(8, 64), temperature=0.0,
                                    apply_chat_template=False)
        elif kind == "cancel":
            model, cancel_after = f"llm_{variant}", 1
            values = request_inputs("Count from 1 to 1000.", max_tokens=256, ignore_eos=True)
        else:
            model, cancel_after = f"llm_{variant}", None
            values = request_inputs("Hi", **rng.choice([{"temperature": -1.0}, {"max_tokens": 0}]))
        if connection_per_request:
            client.close()
            client = grpcclient.InferenceServerClient(url)
        answer: list[str] | None = [] if kind == "turn" else None
        outcome = one_request(client, model, values, request_id, cancel_after, trtllm_format, answer)
        if answer is not None:
            history[-1] = (history[-1][0], "".join(answer))
        expected = {"normal": "ok", "ensemble": "ok", "turn": "ok", "cancel": "cancelled", "bad": "error"}[kind]
        with lock:
            outcomes[f"{kind}:{outcome if outcome in ('ok', 'cancelled', 'error') else 'failed'}"] += 1
            if outcome != expected:
                failures.append(f"{kind} {request_id}: {outcome}")
    client.close()


SWITCHED = "switched to its compiled programs"  # the served model's log line (triton_model.py)


def growth_after(memory: list[dict], start_s: float) -> float:
    """How much "rss_mb" rose above its first sample at or after start_s (0: no sample there)."""
    after = [m["rss_mb"] for m in memory if m["s"] >= start_s]
    return round(max(after) - after[0], 1) if after else 0.0


def soak(url: str, metrics_url: str, server_pid: int, variant: str, minutes: float, concurrency: int,
         sample_s: float, connection_per_request: bool = False, kinds: tuple[str, ...] = tuple(KIND_WEIGHTS),
         cache_max_tokens: int | None = None, max_rss_growth_mb: float = 200.0, log: Path | None = None,
         prompts: list[str] | None = None, drafter_max_tokens: int | None = None) -> dict:
    outcomes: Counter = Counter()
    failures: list[str] = []
    aborted_before = metric(metrics_url, "specserve:request_finished_total", finish_reason="abort")
    lock = threading.Lock()
    start = time.monotonic()
    deadline = start + minutes * 60
    threads = [threading.Thread(target=worker, args=(url, variant, deadline, s, outcomes, failures, lock,
                                                     connection_per_request, kinds, prompts), daemon=True)
               for s in range(concurrency)]
    for t in threads:
        t.start()
    memory: list[dict] = []
    switched_s = None
    while any(t.is_alive() for t in threads):
        memory.append({"s": round(time.monotonic() - start), **server_memory(server_pid),
                       "cached_tokens": metric(metrics_url, CACHED_GAUGE),
                       "drafter_tokens": metric(metrics_url, DRAFTER_GAUGE)})
        if switched_s is None and log is not None and log.exists() and SWITCHED in log.read_text(errors="replace"):
            switched_s = memory[-1]["s"]
        print(json.dumps({**memory[-1], **outcomes}), flush=True)
        for t in threads:
            t.join(timeout=sample_s / len(threads))
    drain_deadline = time.monotonic() + 60
    while time.monotonic() < drain_deadline and any(metric(metrics_url, g) for g in GAUGES):
        time.sleep(0.5)
    gauges = {g: metric(metrics_url, g) for g in GAUGES}
    aborted = metric(metrics_url, "specserve:request_finished_total", finish_reason="abort") - aborted_before
    memory.append({"s": round(time.monotonic() - start), **server_memory(server_pid),
                   "cached_tokens": metric(metrics_url, CACHED_GAUGE),
                   "drafter_tokens": metric(metrics_url, DRAFTER_GAUGE)})
    after_first_minute = [m["rss_mb"] for m in memory if m["s"] >= 60] or [memory[0]["rss_mb"]]
    steady_from = 60 if switched_s is None else max(60, switched_s + 60)
    growth = growth_after(memory, steady_from)
    cached_max = max(m["cached_tokens"] for m in memory)
    drafter_max = max(m["drafter_tokens"] for m in memory)
    report = {
        "variant": variant, "minutes": minutes, "concurrency": concurrency,
        "connection_per_request": connection_per_request, "kinds": list(kinds),
        "outcomes": dict(sorted(outcomes.items())),
        "requests": sum(outcomes.values()), "failures": failures[:50], "num_failures": len(failures),
        "gauges_after": gauges, "engine_aborts": aborted,
        "rss_mb": {"first": memory[0]["rss_mb"], "after_1_min": after_first_minute[0],
                   "max": max(m["rss_mb"] for m in memory), "last": memory[-1]["rss_mb"]},
        "rss_growth_after_1_min_mb": growth_after(memory, 60), "switched_to_compiled_s": switched_s,
        "rss_growth_after_start_up_mb": growth, "start_up_ends_s": steady_from, "max_rss_growth_mb": max_rss_growth_mb,
        "cached_tokens_max": cached_max, "prefix_cache_max_tokens": cache_max_tokens,
        "drafter_tokens_max": drafter_max, "suffix_cache_tokens": drafter_max_tokens,
        "memory_samples": memory,
    }
    # every cancelled stream must have been aborted by the engine, not run to its 256 tokens
    report["passed"] = (not failures and not any(gauges.values()) and aborted >= outcomes["cancel:cancelled"]
                        and growth < max_rss_growth_mb and (cache_max_tokens is None or cached_max <= cache_max_tokens)
                        and (drafter_max_tokens is None or drafter_max <= drafter_max_tokens))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", type=variant_name, default="none")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--sample-s", type=float, default=15.0, help="seconds between memory samples")
    p.add_argument("--connection-per-request", action="store_true",
                   help="open a new gRPC connection for every request (default: one per worker)")
    p.add_argument("--kinds", default=",".join(KIND_WEIGHTS),
                   help="the request kinds drawn, comma-separated (default: all, weighted "
                        + ", ".join(f"{k} {w:.2f}" for k, w in KIND_WEIGHTS.items()) + ")")
    p.add_argument("--prefix-cache-max-tokens", type=int, default=4096,
                   help="the served model's prefix_cache_max_tokens; the cached-tokens gauge must stay within it")
    p.add_argument("--max-rss-growth-mb", type=float, default=200.0,
                   help="the most the server's resident memory may grow after start-up (see above)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="a JSONL of {\"prompt\"} lines the normal and ensemble requests take in turn")
    p.add_argument("--suffix-cache-tokens", type=int, default=None,
                   help="the served model's suffix_cache_tokens; the drafter's gauge must stay within it")
    p.add_argument("--out", type=Path, default=Path("results/soak"))
    args = p.parse_args(argv)
    kinds = tuple(args.kinds.split(","))
    if not kinds or not set(kinds) <= set(KIND_WEIGHTS):
        p.error(f"--kinds: choose among {', '.join(KIND_WEIGHTS)}, got {args.kinds!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    parameters = {"prefix_cache_max_tokens": str(args.prefix_cache_max_tokens)}
    if args.suffix_cache_tokens is not None:
        parameters["suffix_cache_tokens"] = str(args.suffix_cache_tokens)
    prompts = ([json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
               if args.prompts else None)
    with local_server(args.variant, parameters=parameters, log=args.out / "tritonserver.log") as server:
        report = soak(server.grpc_url, server.metrics_url, server.pid, args.variant, args.minutes, args.concurrency,
                      args.sample_s, args.connection_per_request, kinds, args.prefix_cache_max_tokens,
                      args.max_rss_growth_mb, args.out / "tritonserver.log", prompts, args.suffix_cache_tokens)
    (args.out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "memory_samples"}, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
