"""The run and the command: `run` sends a run's requests beside the greedy streams and the readiness
monitor and sums them up (`summarize`, `report`), `replay` sends requests again, and `main` parses
the command line, starts a server where no `--url` names one and writes `<out>/summary.json`.

It holds no strategy (`blocks` and the categories) and no check of a single request (`checks`).
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tritonclient.grpc as grpcclient

from specserve_client.fuzz.blocks import FAMILIES
from specserve_client.fuzz.checks import (
    Outcome,
    ServerWatch,
    fuzz_worker,
    greedy_models,
    greedy_worker,
    readiness_monitor,
    references,
    send,
)
from specserve_client.fuzz.contract import FuzzRequest, request_from_json, request_to_json
from specserve_client.fuzz.drawing import KINDS, generate
from specserve_client.local_server import local_server
from specserve_client.variants import variant_name

# ---- the run -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FuzzConfig:
    requests: int = 2000
    seed: int = 0
    variants: tuple[str, ...] = ("none",)
    concurrency: int = 8
    greedy_streams: int = 4
    timeout_s: float = 120.0
    kinds: tuple[str, ...] = KINDS


def failure_entry(index: int, request: FuzzRequest, outcome: Outcome) -> dict[str, Any]:
    return {"index": index, "kind": request.kind, "model": request.model, "status": outcome.status,
            "problem": outcome.problem, "message": outcome.message[:500], "seconds": outcome.seconds,
            "request": request_to_json(request)}


def slowest(results: list[tuple[int, FuzzRequest, Outcome]], n: int = 10) -> list[dict[str, Any]]:
    """The `n` requests that took longest to end (a stall shows here before it becomes a timeout)."""
    ranked = sorted(results, key=lambda r: -r[2].seconds)[:n]
    return [{"index": i, "kind": r.kind, "model": r.model, "status": o.status, "seconds": o.seconds}
            for i, r, o in ranked]


def summarize(results: list[tuple[int, FuzzRequest, Outcome]]) -> dict[str, Any]:
    """Counts by status and by kind and status, sample messages, the slowest requests, the failures
    (the first 100 with their requests; all of them counted by kind and problem)."""
    by_kind: dict[str, Counter] = defaultdict(Counter)
    messages: dict[str, set] = defaultdict(set)
    failures = []
    for index, request, outcome in sorted(results, key=lambda r: r[0]):
        by_kind[request.kind][outcome.status] += 1
        key = f"{request.kind} {outcome.status}"
        if outcome.message and len(messages[key]) < 5:
            messages[key].add(outcome.message[:200])
        if outcome.problem:
            failures.append(failure_entry(index, request, outcome))
    return {"by_status": dict(Counter(o.status for _, _, o in results)),
            "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
            "messages": {k: sorted(v) for k, v in sorted(messages.items())}, "slowest": slowest(results),
            "num_failures": len(failures), "failures": failures[:100],
            "failure_problems": dict(Counter(f"{f['kind']}: {f['problem']}" for f in failures))}


def start_threads(targets: list[tuple[Callable[..., None], tuple]]) -> list[threading.Thread]:
    threads = [threading.Thread(target=t, args=a, daemon=True) for t, a in targets]
    for t in threads:
        t.start()
    return threads


def watch_until_done(workers: list[threading.Thread], ready: dict, stop: threading.Event) -> None:
    """Wait for the fuzz workers; stop them early once a model is not ready (what would follow
    would say nothing more)."""
    while any(t.is_alive() for t in workers):
        for t in workers:
            t.join(0.5)
        if ready["not_ready"]:
            stop.set()
    stop.set()


def run(url: str, config: FuzzConfig, watch: ServerWatch | None = None) -> dict[str, Any]:
    """The whole fuzz against the server at `url`; its summary (`passed`: every check held)."""
    watch = watch or ServerWatch()
    started = time.monotonic()
    requests = generate(config.requests, config.seed, config.variants, config.kinds)
    generated_s = time.monotonic() - started
    models = greedy_models(config.variants, config.greedy_streams)
    expected = references(url, models, config.timeout_s)
    watch.begin()
    stop, side_stop, lock = threading.Event(), threading.Event(), threading.Lock()
    work: queue.SimpleQueue = queue.SimpleQueue()
    for item in enumerate(requests):
        work.put(item)
    results: list[tuple[int, FuzzRequest, Outcome]] = []
    ready: dict[str, Any] = {"checks": 0, "not_ready": [], "start": time.monotonic()}
    greedy = [{"model": m, "answers": 0, "failures": []} for m in models]
    monitored = sorted({f"{f}_{v}" for v in config.variants for f in FAMILIES} | {"preprocessing"})
    side = start_threads([(readiness_monitor, (url, monitored, side_stop, ready))]
                         + [(greedy_worker, (url, m, expected[m], i, config.timeout_s, side_stop, greedy[i]))
                            for i, m in enumerate(models)])
    fuzz_start = time.monotonic()
    workers = start_threads([(fuzz_worker, (url, work, results, lock, config.timeout_s, stop))
                             for _ in range(config.concurrency)])
    watch_until_done(workers, ready, stop)
    fuzz_s = time.monotonic() - fuzz_start
    side_stop.set()
    for t in side:
        t.join(config.timeout_s)
    timing = {"generate_s": round(generated_s, 1), "fuzz_s": round(fuzz_s, 1)}
    return report(config, len(requests), results, greedy, ready, watch.findings(), timing)


def report(config: FuzzConfig, drawn: int, results: list, greedy: list[dict], ready: dict,
           server: dict[str, Any], timing: dict[str, float]) -> dict[str, Any]:
    summary = summarize(results)
    greedy_failures = [f for g in greedy for f in g["failures"]]
    passed = (summary["num_failures"] == 0 and len(results) == drawn > 0
              and not greedy_failures and not ready["not_ready"] and not ServerWatch.failed(server))
    return {
        "passed": passed, "requests": config.requests, "drawn": drawn, "sent": len(results),
        "seed": config.seed, "variants": list(config.variants), "concurrency": config.concurrency,
        "timeout_s": config.timeout_s, **timing, **summary,
        "greedy": {"streams": [{k: g[k] for k in ("model", "answers")} for g in greedy],
                   "num_failures": len(greedy_failures), "failures": greedy_failures[:20]},
        "readiness": {"checks": ready["checks"], "not_ready": ready["not_ready"][:20]},
        "server": server,
    }


def replay(url: str, requests: list[FuzzRequest], timeout_s: float) -> list[dict[str, Any]]:
    """Send each request again, one at a time: its outcome."""
    client = grpcclient.InferenceServerClient(url)
    try:
        return [{"kind": r.kind, "model": r.model, **vars(send(client, r, f"replay-{i}", timeout_s))}
                for i, r in enumerate(requests)]
    finally:
        client.close()


def load_requests(path: Path) -> list[FuzzRequest]:
    """Requests from a summary (its failures) or from a JSON list of requests (or one request)."""
    obj = json.loads(path.read_text())
    if isinstance(obj, dict) and "failures" in obj:
        obj = [f["request"] for f in obj["failures"]]
    return [request_from_json(r) for r in (obj if isinstance(obj, list) else [obj])]


# ---- the command -------------------------------------------------------------------------------

# the server started here: float32 (greedy answers independent of batching), every step on the
# compiled programs from the first request on (no switch of engine while the fuzz runs)
SERVER_PARAMETERS = {"dtype": "float32", "serve_while_compiling": "false", "compiled_steps": "always"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    description = sys.modules[__package__].__doc__.splitlines()[0]  # the package's docstring
    p = argparse.ArgumentParser(prog="python -m specserve_client.fuzz", description=description)
    p.add_argument("--url", help="gRPC host:port of a running server (default: start one here)")
    p.add_argument("--pid", type=int, help="with --url: tritonserver's pid, to check it kept running")
    p.add_argument("--log", type=Path, help="with --url: tritonserver's log, to check for crashes")
    p.add_argument("--variants", default="none", help="comma-separated; fuzzes llm_<v> and ensemble_<v>")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=8, help="fuzz requests in flight")
    p.add_argument("--greedy-streams", type=int, default=4)
    p.add_argument("--timeout-s", type=float, default=120.0, help="per request")
    p.add_argument("--kinds", default=",".join(KINDS), help="categories drawn, comma-separated")
    p.add_argument("--parameter", action="append", default=[], metavar="KEY=VALUE",
                   help="a config.pbtxt parameter of the llm models of the server started here (default: "
                        + ", ".join(f"{k}={v}" for k, v in SERVER_PARAMETERS.items()) + ")")
    p.add_argument("--replay", type=Path, help="send a summary's failing requests (or a JSON list) again")
    p.add_argument("--out", type=Path, default=Path("results/fuzz"))
    args = p.parse_args(argv)
    args.variants = tuple(variant_name(v) for v in args.variants.split(","))
    args.kinds = tuple(args.kinds.split(","))
    if not set(args.kinds) <= set(KINDS):
        p.error(f"--kinds: choose among {', '.join(KINDS)}")
    return args


def server_parameters(pairs: list[str]) -> dict[str, str]:
    return SERVER_PARAMETERS | dict(pair.split("=", 1) for pair in pairs)


def run_against(args: argparse.Namespace, url: str, watch: ServerWatch) -> dict[str, Any]:
    if args.replay:
        return {"replay": replay(url, load_requests(args.replay), args.timeout_s)}
    config = FuzzConfig(args.requests, args.seed, args.variants, args.concurrency, args.greedy_streams,
                        args.timeout_s, args.kinds)
    return run(url, config, watch)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.url:
        result = run_against(args, args.url, ServerWatch(args.pid, args.log))
    else:
        log, parameters = args.out / "tritonserver.log", server_parameters(args.parameter)
        with local_server(",".join(args.variants), parameters=parameters, log=log) as server:
            result = run_against(args, server.grpc_url, ServerWatch(server.pid, log))
    if "replay" in result:
        print(json.dumps(result["replay"], indent=1))
        return 0
    (args.out / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("failures", "messages")}, indent=1))
    print(f"summary: {args.out / 'summary.json'}", file=sys.stderr)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
