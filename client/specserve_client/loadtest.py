"""Load-test `llm_<variant>` with perf_analyzer (gRPC streaming) over a range of concurrencies.

    python -m specserve_client.loadtest --variant none --concurrency 1,2,4,8 \\
        --num-prompts 16 --max-tokens 64 --out results/loadtest

Builds a perf_analyzer input-data JSON from MT-bench first turns (chat template on, greedy,
min_tokens = max_tokens so every request generates exactly --max-tokens tokens), runs
`perf_analyzer -i grpc --streaming --request-count N` per concurrency, and computes from its
per-response profile export what matters for an LLM: output tokens/s, requests/s, time to first
token, inter-token latency, end-to-end latency and accept length. Writes `<out>/loadtest.md`
(a table), `<out>/loadtest.json`, and `<out>/loadtest.png` when matplotlib is importable.
The server is started here unless --url points at a running one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specserve_client.datasets import load_prompts
from specserve_client.local_server import add_server_arguments, server_for
from specserve_client.variants import variant_name


@dataclass(frozen=True)
class LoadPoint:
    concurrency: int
    requests: int
    requests_per_s: float
    output_tokens_per_s: float
    mean_ttft_ms: float
    p90_ttft_ms: float
    mean_itl_ms: float  # inter-token latency (time per output token after the first)
    p50_latency_ms: float
    p90_latency_ms: float
    mean_accept_length: float


def input_data(prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """perf_analyzer's --input-data JSON: one entry per prompt, BYTES as strings."""
    return {
        "data": [
            {
                "text_input": [p],
                "max_tokens": [max_tokens],
                "min_tokens": [max_tokens],
                "stream": [True],
                "exclude_input_in_output": [True],
                "apply_chat_template": [True],
            }
            for p in prompts
        ]
    }


def perf_analyzer_env() -> dict[str, str]:
    """perf_analyzer from tritonclient 2.50 needs libcudart (nvidia-cuda-runtime-cu12) on the path."""
    import importlib.util

    dirs = []
    spec = importlib.util.find_spec("nvidia")
    for base in spec.submodule_search_locations if spec and spec.submodule_search_locations else []:
        lib = Path(base) / "cuda_runtime" / "lib"
        if lib.is_dir():
            dirs.append(str(lib))
    ld = os.pathsep.join([*dirs, os.environ.get("LD_LIBRARY_PATH", "")]).strip(os.pathsep)
    return {**os.environ, "LD_LIBRARY_PATH": ld}


def find_perf_analyzer() -> str:
    here = Path(sys.executable).parent / "perf_analyzer"
    found = str(here) if here.is_file() else shutil.which("perf_analyzer")
    if not found:
        raise FileNotFoundError("perf_analyzer: not found (pip install tritonclient[all]==2.50.0)")
    return found


def run_perf_analyzer(url: str, model: str, data: Path, concurrency: int, num_requests: int, out: Path) -> Path:
    export = out / f"profile_c{concurrency}.json"
    export.unlink(missing_ok=True)  # perf_analyzer refuses to overwrite it
    cmd = [
        find_perf_analyzer(), "-m", model, "-i", "grpc", "--streaming", "-u", url,
        "--input-data", str(data), "--concurrency-range", f"{concurrency}:{concurrency}",
        "--request-count", str(num_requests),
        "-f", str(out / f"perf_analyzer_c{concurrency}.csv"), "--profile-export-file", str(export),
    ]
    proc = subprocess.run(cmd, env=perf_analyzer_env(), capture_output=True, text=True)
    (out / f"perf_analyzer_c{concurrency}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        hint = " (apt-get install libb64-0d)" if "libb64" in proc.stderr else ""
        errors = [line for line in (proc.stderr + proc.stdout).splitlines() if "rror" in line][:5]
        raise RuntimeError(f"perf_analyzer failed{hint}: {' '.join(cmd)}\n"
                           + "\n".join(errors or [proc.stderr[-2000:]]))
    return export


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(export: Path, concurrency: int) -> LoadPoint:
    """Per-request numbers from perf_analyzer's profile export (timestamps in ns)."""
    requests = json.loads(export.read_text())["experiments"][0]["requests"]
    requests = [r for r in requests if r.get("response_timestamps")]
    if not requests:
        raise RuntimeError(f"{export}: no request got a response")
    ttft, itl, latency, tokens, accept = [], [], [], [], []
    for r in requests:
        start, stamps = r["timestamp"], r["response_timestamps"]
        outputs = [o for o in r.get("response_outputs", []) if o]
        n = sum(int(o["num_output_tokens"]) for o in outputs) if outputs else len(stamps)  # per response
        ttft.append((stamps[0] - start) / 1e6)
        latency.append((stamps[-1] - start) / 1e6)
        if n > 1:
            itl.append((stamps[-1] - stamps[0]) / 1e6 / (n - 1))
        tokens.append(n)
        if outputs:
            accept.append(float(outputs[-1].get("accept_length", 1.0)))
    span_s = (max(r["response_timestamps"][-1] for r in requests) - min(r["timestamp"] for r in requests)) / 1e9
    return LoadPoint(
        concurrency=concurrency,
        requests=len(requests),
        requests_per_s=len(requests) / span_s,
        output_tokens_per_s=sum(tokens) / span_s,
        mean_ttft_ms=statistics.fmean(ttft),
        p90_ttft_ms=_percentile(ttft, 0.9),
        mean_itl_ms=statistics.fmean(itl) if itl else 0.0,
        p50_latency_ms=_percentile(latency, 0.5),
        p90_latency_ms=_percentile(latency, 0.9),
        mean_accept_length=statistics.fmean(accept) if accept else 1.0,
    )


def markdown(points: list[LoadPoint], title: str) -> str:
    rows = [
        f"### {title}",
        "",
        "| concurrency | requests | req/s | output tok/s | TTFT mean (ms) | TTFT p90 (ms) | ITL mean (ms) "
        "| latency p50 (ms) | latency p90 (ms) | accept length |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        rows.append(
            f"| {p.concurrency} | {p.requests} | {p.requests_per_s:.2f} | {p.output_tokens_per_s:.1f} "
            f"| {p.mean_ttft_ms:.0f} | {p.p90_ttft_ms:.0f} | {p.mean_itl_ms:.1f} | {p.p50_latency_ms:.0f} "
            f"| {p.p90_latency_ms:.0f} | {p.mean_accept_length:.2f} |"
        )
    return "\n".join(rows) + "\n"


def plot(points: list[LoadPoint], title: str, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    c = [p.concurrency for p in points]
    ax1.plot(c, [p.output_tokens_per_s for p in points], marker="o")
    ax1.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    ax2.plot(c, [p.mean_ttft_ms for p in points], marker="o", label="TTFT mean")
    ax2.plot(c, [p.mean_itl_ms for p in points], marker="o", label="inter-token mean")
    ax2.set(xlabel="concurrency", ylabel="ms", title="latency")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve_client.loadtest", description=__doc__.splitlines()[0])
    p.add_argument("--variant", type=variant_name, default="none")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated levels")
    p.add_argument("--dataset", default="mtbench", help="mtbench or a JSONL file")
    p.add_argument("--num-prompts", type=int, default=16, help="requests per concurrency level (at least the level)")
    p.add_argument("--max-tokens", type=int, default=64)
    add_server_arguments(p, "torch threads of the engine (on a server started here)")
    p.add_argument("--out", type=Path, default=Path("results/loadtest"))
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]

    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "input_data.json"
    data.write_text(json.dumps(input_data(load_prompts(args.dataset, args.num_prompts), args.max_tokens)))
    model = f"llm_{args.variant}"
    overrides = {"num_threads": str(args.num_threads)} if args.num_threads else {}
    points = []
    with server_for(args.variant, args.url, args.repository, overrides, args.out / "tritonserver.log") as url:
        for c in levels:
            print(f"concurrency {c} ...", flush=True)
            export = run_perf_analyzer(url, model, data, c, max(args.num_prompts, c), args.out)
            points.append(summarize(export, c))
            print(f"  {points[-1].output_tokens_per_s:.1f} output tok/s, TTFT {points[-1].mean_ttft_ms:.0f} ms",
                  flush=True)
    title = f"{model}: {args.max_tokens} output tokens, {args.dataset}"
    table = markdown(points, title)
    (args.out / "loadtest.md").write_text(table)
    (args.out / "loadtest.json").write_text(json.dumps([asdict(p) for p in points], indent=2))
    plotted = plot(points, title, args.out / "loadtest.png")
    print(table)
    print(f"wrote {args.out}/loadtest.md, loadtest.json"
          + (", loadtest.png" if plotted else " (no matplotlib: no plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
