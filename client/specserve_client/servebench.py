"""How much does serving through Triton cost? Streamed tokens/s through `llm_<variant>` vs the same
engine in-process, on the same MT-bench prompts (chat template, greedy, same max tokens).

    python -m specserve_client.servebench --variant none --num-prompts 8 --max-tokens 64 \\
        --json results/servebench.json

1. in-process: `Engine` built from llm_<variant>'s config.pbtxt parameters, run by its
   `EngineLoop` thread, one request at a time (tokens/s = generated tokens / wall time, prefill included);
2. Triton, concurrency 1: the same prompts one after another over gRPC streaming;
3. Triton, concurrency C (default 8): C clients draining the same prompt list; aggregate tokens/s.
The server is started here (a `TritonProcess` on free ports, with --num-threads applied to its
engine too) unless --url points at a running one.
"""

from __future__ import annotations

import argparse
import gc
import json
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

from specserve_client.datasets import load_prompts
from specserve_client.local_server import add_server_arguments, server_for
from specserve_client.stream import collect, grpc_stream
from specserve_client.variants import variant_name


def in_process(variant_params: dict[str, str], prompt_ids: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """The engine on its own `EngineLoop` thread (built there too), as the Triton model runs it, minus Triton."""
    from specserve.config import SamplingParams
    from specserve.engine.engine import Engine, merge_outputs
    from specserve.engine.loop import EngineLoop
    from specserve.serving.parameters import engine_config_from_parameters

    loop = EngineLoop(lambda: Engine(engine_config_from_parameters(variant_params)))

    def run(ids: list[int], params: SamplingParams) -> Any:
        done, merged = threading.Event(), [None]

        def on_output(out: Any) -> None:
            merged[0] = merge_outputs(merged[0], out)
            if out.finished:
                done.set()

        loop.submit(ids, params, on_output)
        done.wait()
        return merged[0]

    try:
        run(prompt_ids[0], SamplingParams(max_tokens=4))  # warm-up
        outputs, start = [], time.perf_counter()
        for ids in prompt_ids:
            outputs.append(run(ids, SamplingParams(max_tokens=max_tokens)))
        elapsed = time.perf_counter() - start
    finally:
        loop.shutdown()
    tokens = sum(len(o.token_ids) for o in outputs)
    gc.collect()
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "token_ids": [o.token_ids for o in outputs]}


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

    from specserve.serving.parameters import model_dir_from_parameters
    from specserve.serving.parsing import PromptTokenizer
    from specserve.serving.server import default_repository, read_parameters

    repository = args.repository or default_repository()
    params = read_parameters(repository / f"llm_{args.variant}" / "config.pbtxt")
    overrides = {"num_threads": str(args.num_threads)} if args.num_threads else {}
    params.update(overrides)
    prompts = load_prompts(args.dataset, args.num_prompts)
    tokenizer = PromptTokenizer(model_dir_from_parameters(params))
    prompt_ids = [tokenizer.encode(q, True) for q in prompts]

    print(f"in-process engine ({args.variant}), {len(prompts)} prompts x {args.max_tokens} tokens ...", flush=True)
    local = in_process(params, prompt_ids, args.max_tokens)
    print(f"  {local['tokens_per_s']:.1f} tok/s", flush=True)

    model = f"llm_{args.variant}"
    log = args.json.with_suffix(".tritonserver.log")
    with server_for(args.variant, args.url, repository, overrides, log) as url:
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
        "engine": {k: params.get(k) for k in ("algorithm", "max_batch_size", "max_seq_len", "dtype", "num_threads")},
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
