"""Profile a served variant with genai-perf over a range of concurrencies (`make profile`).

    python -m specserve_client.profile --variant none --concurrency 1,2,4,8 --out results/profile

Runs `genai-perf profile --endpoint-type kserve --backend vllm --streaming` against `llm_<variant>`
(or `--backend tensorrtllm` against the ensemble `ensemble_<variant>`, in its [1, 1] format) (synthetic prompts
tokenized by the served model's tokenizer) once per concurrency, each into its own artifact
directory `<out>/c<N>/`, then collects genai-perf's own figures (output tokens/s, requests/s, time
to first token, inter-token latency, request latency) into `<out>/profile.json`, `<out>/profile.md`
and `<out>/profile.png`. genai-perf lives in its own virtual environment (its pins clash with the
server's); it drives the perf_analyzer of this environment. The server is started here unless
--url points at a running one. It computes no latency figure itself: every number is genai-perf's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from specserve_client.loadtest import find_perf_analyzer, perf_analyzer_env
from specserve_client.local_server import add_server_arguments, server_for
from specserve_client.variants import variant_name

GENAI_PERF = Path(".venv-genai-perf/bin/genai-perf")
# (column, genai-perf metric, statistic)
FIGURES = [
    ("output_tokens_per_s", "output_token_throughput", "avg"),
    ("requests_per_s", "request_throughput", "avg"),
    ("mean_ttft_ms", "time_to_first_token", "avg"),
    ("p90_ttft_ms", "time_to_first_token", "p90"),
    ("mean_itl_ms", "inter_token_latency", "avg"),
    ("p50_latency_ms", "request_latency", "p50"),
    ("p90_latency_ms", "request_latency", "p90"),
    ("mean_output_tokens", "output_sequence_length", "avg"),
]


MODEL_PREFIX = {"vllm": "llm", "tensorrtllm": "ensemble"}  # genai-perf's request format -> the model that takes it


def genai_perf_command(genai_perf: Path, url: str, model: str, backend: str, tokenizer: str, concurrency: int,
                       requests: int, input_tokens: int, output_tokens: int, artifacts: Path,
                       extra_inputs: dict[str, str] | None = None) -> list[str]:
    """`extra_inputs`: tensors genai-perf adds to every request, given as one JSON object (its
    `--extra-inputs NAME:VALUE` form takes no value with a colon, as a JSON schema has)."""
    # No --warmup-request-count: with it, tritonclient 2.50's perf_analyzer never ends its
    # measurement against a decoupled model.
    extra = ["--extra-inputs", json.dumps(extra_inputs)] if extra_inputs else []
    return [
        str(genai_perf), "profile", "-m", model, "--endpoint-type", "kserve", "--backend", backend, "--streaming",
        "-u", url, "--tokenizer", tokenizer, "--concurrency", str(concurrency), "--request-count", str(requests),
        "--synthetic-input-tokens-mean", str(input_tokens), "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(output_tokens), "--output-tokens-mean-deterministic",
        "--random-seed", "0", "--artifact-dir", str(artifacts), *extra,
    ]


def figures(export: Path) -> dict[str, float]:
    """genai-perf's profile_export_genai_perf.json -> the columns of FIGURES."""
    data = json.loads(export.read_text())
    return {name: round(float(data[metric][stat]), 2) for name, metric, stat in FIGURES}


def write_report(out: Path, rows: list[dict], meta: dict) -> None:
    (out / "profile.json").write_text(json.dumps({"meta": meta, "points": rows}, indent=1) + "\n")
    names = ["concurrency"] + [name for name, _, _ in FIGURES]
    lines = ["| " + " | ".join(names) + " |", "|" + "---:|" * len(names)]
    lines += ["| " + " | ".join(str(r[n]) for n in names) + " |" for r in rows]
    (out / "profile.md").write_text(f"genai-perf {meta['genai_perf_version']} against `{meta['model']}`\n\n"
                                    + "\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    c = [r["concurrency"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, (key, label) in zip(axes, [("output_tokens_per_s", "output tokens/s"), ("mean_ttft_ms", "mean TTFT (ms)"),
                                       ("mean_itl_ms", "mean inter-token latency (ms)")]):
        ax.plot(c, [r[key] for r in rows], marker="o")
        ax.set_xlabel("concurrency")
        ax.set_title(label)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    fig.suptitle(f"genai-perf, {meta['model']}")
    fig.tight_layout()
    fig.savefig(out / "profile.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", type=variant_name, default="none")
    p.add_argument("--backend", choices=sorted(MODEL_PREFIX), default="vllm",
                   help="genai-perf's request format: vllm (llm_<variant>) or tensorrtllm (ensemble_<variant>)")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated")
    p.add_argument("--requests", type=int, default=16, help="requests measured per concurrency")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--tokenizer", default="models/SmolLM2-135M-Instruct", help="the served model's directory")
    p.add_argument("--genai-perf", type=Path, default=GENAI_PERF, help="the genai-perf executable")
    p.add_argument("--structured-schema", type=Path, default=None,
                   help="a JSON schema file every request's output must follow (sent as TensorRT-LLM's "
                        "guided_decoding_guide_type / guided_decoding_guide tensors, which both models take)")
    p.add_argument("--out", type=Path, default=Path("results/profile"))
    add_server_arguments(p, "unused (the server's settings apply)")
    args = p.parse_args(argv)
    if not args.genai_perf.is_file():
        print(f"error: {args.genai_perf} not found (make profile installs it)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    env = perf_analyzer_env()
    env["PATH"] = os.pathsep.join([str(Path(find_perf_analyzer()).parent), env.get("PATH", "")])
    model = f"{MODEL_PREFIX[args.backend]}_{args.variant}"
    version = subprocess.run([str(args.genai_perf), "--version"], capture_output=True, text=True,
                             env=env).stdout.strip().removeprefix("genai-perf").strip()
    extra = None
    if args.structured_schema is not None:
        schema = json.dumps(json.loads(args.structured_schema.read_text()), separators=(",", ":"))
        extra = {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": schema}
    rows = []
    with server_for(args.variant, args.url, args.repository) as url:
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            artifacts = args.out / f"c{concurrency}"
            cmd = genai_perf_command(args.genai_perf, url, model, args.backend, args.tokenizer, concurrency,
                                     args.requests, args.input_tokens, args.output_tokens, artifacts, extra)
            print(" ".join(cmd), flush=True)
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            (args.out / f"genai_perf_c{concurrency}.log").write_text(proc.stdout + proc.stderr)
            exports = sorted(artifacts.rglob("profile_export_genai_perf.json"))
            if proc.returncode != 0 or not exports:
                print(f"error: genai-perf failed at concurrency {concurrency}; see {args.out}", file=sys.stderr)
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            rows.append({"concurrency": concurrency, **figures(exports[-1])})
            print(json.dumps(rows[-1]), flush=True)
    meta = {"model": model, "backend": args.backend, "genai_perf_version": version, "requests": args.requests,
            "input_tokens": args.input_tokens, "output_tokens": args.output_tokens,
            "structured_schema": str(args.structured_schema) if args.structured_schema else None}
    write_report(args.out, rows, meta)
    print((args.out / "profile.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
