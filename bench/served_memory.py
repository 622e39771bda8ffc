"""Resident memory of a served `llm_<variant>` per weight format, through a real tritonserver.

    python bench/served_memory.py --variant none --formats gguf,safetensors --out results/served_memory.json

For each `load_format` in turn: `specserve serve` of llm_<variant> alone (free loopback ports), a
short greedy stream every few seconds until the model has switched to its compiled programs (the
model's log says so; a CPU build serves eagerly until then), then 8 streams, then the resident
memory of the model's Python-backend stub (and tritonserver's) sampled `--samples` times a second
apart: the median, with its anon / file / shmem parts (`specserve_client.soak.resident_mb`).
The formats run one after the other on the same machine, so their difference is the weights' and
programs'. It does not measure speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specserve_client.local_server import local_server
from specserve_client.soak import SWITCHED, resident_mb, server_processes
from specserve_client.stream import collect, grpc_stream

PROMPT = "Explain in two sentences why the sky is blue."


def _stream(url: str, model: str, tokens: int) -> int:
    """One greedy stream; the tokens it generated."""
    g = collect(grpc_stream(url, model, PROMPT, max_tokens=tokens, temperature=0.0, ignore_eos=True,
                            apply_chat_template=True, return_num_output_tokens=True))
    return int(g.stats.get("num_output_tokens", 0))


def measure(variant: str, load_format: str, samples: int, switch_timeout_s: float, log: Path) -> dict:
    model = f"llm_{variant}"
    with local_server(variant, parameters={"load_format": load_format}, log=log) as server:
        started, switched_s = time.monotonic(), None
        while time.monotonic() - started < switch_timeout_s:
            _stream(server.grpc_url, model, 4)
            if SWITCHED in log.read_text(errors="replace"):
                switched_s = round(time.monotonic() - started, 1)
                break
            time.sleep(2.0)
        generated = sum(_stream(server.grpc_url, model, 32) for _ in range(8))
        time.sleep(2.0)
        stub = {name: pid for name, pid in server_processes(server.pid).items() if model in name}
        assert len(stub) == 1, f"expected one stub serving {model}, found {sorted(stub)}"
        (stub_name, stub_pid), = stub.items()
        readings = []
        for _ in range(samples):
            readings.append((resident_mb(stub_pid), resident_mb(server.pid)))
            time.sleep(1.0)
    part = {key: statistics.median(r[0][key] for r in readings) for key in readings[0][0]}
    return {"load_format": load_format, "switched_to_compiled_s": switched_s, "tokens": generated,
            "stub": stub_name.split(" (")[0], "stub_rss_mb": part.pop("rss"), "stub_parts_mb": part,
            "tritonserver_rss_mb": statistics.median(r[1]["rss"] for r in readings)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="none")
    p.add_argument("--formats", default="gguf,safetensors")
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--switch-timeout-s", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=Path("results/served_memory.json"))
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for fmt in args.formats.split(","):
        rows.append(measure(args.variant, fmt, args.samples, args.switch_timeout_s,
                            args.out.parent / f"tritonserver-{args.variant}-{fmt}.log"))
        print(json.dumps(rows[-1]), flush=True)
    first, *rest = rows
    result = {"variant": args.variant, "rows": rows,
              "saved_mb": {r["load_format"]: round(r["stub_rss_mb"] - first["stub_rss_mb"], 1) for r in rest}}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["saved_mb"]))


if __name__ == "__main__":
    main()
