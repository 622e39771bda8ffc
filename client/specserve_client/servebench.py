"""How much does serving through Triton cost? Streamed tokens/s through `llm_<variant>` vs the same
engine in-process, on the same MT-bench prompts (chat template, greedy, same max tokens).

    python -m specserve_client.servebench --variant none --num-prompts 8 --max-tokens 64 \\
        --json results/servebench.json

1. in-process: `Engine` built from llm_<variant>'s config.pbtxt parameters, run by its
   `EngineLoop` thread, one request at a time (tokens/s = generated tokens / wall time, prefill included):
   the server package's `specserve in-process-bench`, run here as a subprocess (JSON back);
2. Triton, concurrency 1: the same prompts one after another over gRPC streaming;
3. Triton, concurrency C (default 8): C clients draining the same prompt list; aggregate tokens/s.
The server is started here (a `TritonProcess` on free ports, with --num-threads applied to its
engine too) unless --url points at a running one. The in-process side runs in its own process,
so this module has no import of the server package.
"""

from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from specserve_client.datasets import load_prompts
from specserve_client.local_server import add_server_arguments, server_for
from specserve_client.stream import collect, grpc_stream
from specserve_client.variants import variant_name


def in_process(variant: str, dataset: str, num_prompts: int, max_tokens: int, repository: Path | None,
               num_threads: int | None) -> dict[str, Any]:
    """`specserve in-process-bench` (the server package's command) in a subprocess of this
    interpreter, its JSON read back: engine, tokens, seconds, tokens_per_s, token_ids."""
    with tempfile.TemporaryDirectory(prefix="specserve-servebench-") as tmp:
        out = Path(tmp) / "in_process.json"
        command = [sys.executable, "-m", "specserve.cli", "in-process-bench", "--variant", variant,
                   "--dataset", dataset, "--num-prompts", str(num_prompts), "--max-tokens", str(max_tokens),
                   "--json", str(out)]
        if repository is not None:
            command += ["--repository", str(repository)]
        if num_threads:
            command += ["--num-threads", str(num_threads)]
        proc = subprocess.run(command, check=False)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(
                f"the in-process engine (`{' '.join(command[1:4])}`) exited with code {proc.returncode}; "
                "it needs the server package `specserve` (install the project root)"
            )
        return json.loads(out.read_text())


def through_triton(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int) -> dict[str, Any]:
    todo: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
    for item in enumerate(prompts):
        todo.put(item)
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            try:
                i, prompt = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = collect(grpc_stream(url, model, prompt, max_tokens=max_tokens, apply_chat_template=True))
            except BaseException as e:  # noqa: BLE001 - reported after the run
                errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    gens = [results[i] for i in range(len(prompts))]
    tokens = sum(len(g.token_ids) for g in gens)
    ttfts = sorted(g.time_to_first_token_s for g in gens if g.time_to_first_token_s is not None)
    return {
        "concurrency": concurrency,
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "token_ids": [g.token_ids for g in gens],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve_client.servebench", description=__doc__.splitlines()[0])
    p.add_argument("--variant", type=variant_name, default="none")
    p.add_argument("--dataset", default="mtbench")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    add_server_arguments(p, "torch threads for both engines (default: the config's)")
    p.add_argument("--json", type=Path, default=Path("results/servebench.json"))
    args = p.parse_args(argv)

    overrides = {"num_threads": str(args.num_threads)} if args.num_threads else {}
    prompts = load_prompts(args.dataset, args.num_prompts)

    print(f"in-process engine ({args.variant}), {len(prompts)} prompts x {args.max_tokens} tokens ...", flush=True)
    local = in_process(args.variant, args.dataset, args.num_prompts, args.max_tokens, args.repository, args.num_threads)
    print(f"  {local['tokens_per_s']:.1f} tok/s", flush=True)

    model = f"llm_{args.variant}"
    log = args.json.with_suffix(".tritonserver.log")
    with server_for(args.variant, args.url, args.repository, overrides, log) as url:
        collect(grpc_stream(url, model, prompts[0], max_tokens=4, apply_chat_template=True))  # warm-up
        print("Triton, concurrency 1 ...", flush=True)
        c1 = through_triton(url, model, prompts, args.max_tokens, 1)
        print(f"  {c1['tokens_per_s']:.1f} tok/s", flush=True)
        print(f"Triton, concurrency {args.concurrency} ...", flush=True)
        cn = through_triton(url, model, prompts, args.max_tokens, args.concurrency)
        print(f"  {cn['tokens_per_s']:.1f} tok/s aggregate", flush=True)

    same_c1 = sum(a == b for a, b in zip(local["token_ids"], c1["token_ids"]))
    result = {
        "variant": args.variant,
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "engine": local["engine"],
        "in_process_tokens_per_s": local["tokens_per_s"],
        "triton_c1_tokens_per_s": c1["tokens_per_s"],
        "triton_c1_mean_ttft_s": c1["mean_ttft_s"],
        f"triton_c{args.concurrency}_tokens_per_s": cn["tokens_per_s"],
        f"triton_c{args.concurrency}_mean_ttft_s": cn["mean_ttft_s"],
        "c1_vs_in_process": c1["tokens_per_s"] / local["tokens_per_s"],
        f"c{args.concurrency}_vs_c1": cn["tokens_per_s"] / c1["tokens_per_s"],
        "c1_outputs_identical_to_in_process": f"{same_c1}/{len(prompts)}",
        "tokens": {"in_process": local["tokens"], "c1": c1["tokens"], f"c{args.concurrency}": cn["tokens"]},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
