"""Structured outputs through a real server: does every answer follow its JSON schema?

    python -m specserve_client.structured_check --variants none,ngram,eagle,eagle3,mtp,standalone,suffix \
        --dataset bench/structured.jsonl --dataset bench/structured_heldout.jsonl --out results/structured_check

Each line of each data set ({"prompt", "schema"}) goes, greedy, with the chat template, to
`llm_<variant>` with vLLM's `structured_outputs` and to `ensemble_<variant>` with TensorRT-LLM's
`guided_decoding_guide_type` / `guided_decoding_guide`, `--concurrency` requests at a time. An
answer that ended on its own must parse and validate against its schema (the `jsonschema`
package); one cut at `--max-tokens` is counted apart. Writes `<out>/structured_check.json` (per
model and data set: valid, invalid, cut, the invalid texts) and exits 1 when any answer is invalid
or more than `--max-cut-fraction` are cut. Unless given `--url` it starts its own server for each
variant in turn, so the host holds one variant's models at a time (on a CPU each holds about 3 GB,
and seven in one server thrashed a 24 GB host while their programs were built); it measures no speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specserve_client.datasets import load_questions, load_schemas
from specserve_client.local_server import add_server_arguments, server_for
from specserve_client.stream import collect, grpc_stream
from specserve_client.variants import variant_name

TIMEOUT_S = 300.0


def ask(url: str, model: str, prompt: str, schema: dict, max_tokens: int) -> tuple[str, str | None]:
    """One greedy request under `schema`, in the request form of the model: (text, finish_reason)."""
    if model.startswith("ensemble_"):
        form = {"trtllm_format": True, "guided_decoding_guide_type": "json_schema",
                "guided_decoding_guide": json.dumps(schema)}
    else:
        form = {"sampling_parameters": json.dumps({"structured_outputs": {"json": schema}})}
    g = collect(grpc_stream(url, model, prompt, max_tokens=max_tokens, apply_chat_template=True,
                            timeout_s=TIMEOUT_S, **form))
    return g.text, g.finish_reason


def verdict(text: str, finish_reason: str | None, schema: dict) -> str:
    """valid, invalid or cut (ended at max_tokens: a grammar cannot end what it had no room for)."""
    import jsonschema

    if finish_reason == "length":
        return "cut"
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return "invalid"
    return "valid"


def check(url: str, model: str, dataset: str, max_tokens: int, concurrency: int) -> dict:
    prompts, schemas = load_questions(dataset), load_schemas(dataset)
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda ps: ask(url, model, ps[0], ps[1], max_tokens), zip(prompts, schemas)))
    row: dict = {"valid": 0, "invalid": 0, "cut": 0, "invalid_texts": []}
    for (text, reason), schema in zip(answers, schemas):
        kind = verdict(text, reason, schema)
        row[kind] += 1
        if kind == "invalid":
            row["invalid_texts"].append(text)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="none,ngram,eagle,eagle3,mtp,standalone,suffix,hybrid", help="comma-separated")
    p.add_argument("--dataset", action="append", help="a structured JSONL (repeatable; default: bench's two)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-cut-fraction", type=float, default=0.05)
    p.add_argument("--out", type=Path, default=Path("results/structured_check"))
    add_server_arguments(p, "unused (the server's settings apply)")
    args = p.parse_args(argv)
    variants = [variant_name(v) for v in args.variants.split(",")]
    datasets = args.dataset or ["bench/structured.jsonl", "bench/structured_heldout.jsonl"]
    results: dict = {}
    for variant in variants:
        with server_for(variant, args.url, args.repository) as url:
            for model in (f"llm_{variant}", f"ensemble_{variant}"):
                for dataset in datasets:
                    row = check(url, model, dataset, args.max_tokens, args.concurrency)
                    results[f"{model} {dataset}"] = row
                    print(f"{model:<22} {dataset:<34} valid {row['valid']:>3}  invalid {row['invalid']:>3}  "
                          f"cut {row['cut']:>3}", flush=True)
    total = sum(r["valid"] + r["invalid"] + r["cut"] for r in results.values())
    invalid, cut = sum(r["invalid"] for r in results.values()), sum(r["cut"] for r in results.values())
    summary = {"answers": total, "invalid": invalid, "cut": cut, "cut_fraction": round(cut / max(total, 1), 4),
               "max_tokens": args.max_tokens, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    ok = invalid == 0 and cut <= args.max_cut_fraction * total
    print(f"{total} answers: {invalid} invalid, {cut} cut at max_tokens ({summary['cut_fraction']:.1%}): "
          f"{'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
