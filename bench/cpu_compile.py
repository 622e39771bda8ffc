"""Eager against compiled (AOTInductor) forwards on the CPU, side by side on the same prompts.

For each algorithm, an engine with `cpu_compile` off and one with it on run every chunk of prompts
in turn (interleaved, as `specserve bench` runs its engines), greedy, served defaults; the JSON
gives both engines' tokens per second, their ratio, whether their outputs are the same, and where
step time goes (`StepProfile`). Compiled programs come from the compile cache (compiled on first
use).

    .venv/bin/python bench/cpu_compile.py --algorithm none,eagle,mtp --dataset mtbench --num-prompts 12 \
        --max-new-tokens 128 --json results/cpu_compile.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from specserve.bench import EngineRun
from specserve.config import EngineConfig, SpecConfig
from specserve.engine.engine import Engine
from specserve.hardware import auto_dtype, describe
from specserve.prepare import default_model_dir
from specserve.prompts import load_questions, render_chat
from specserve.serving.repository import served_drafter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="none,eagle,eagle3,mtp")
    p.add_argument("--dataset", default="mtbench")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--json", default="results/cpu_compile.json")
    args = p.parse_args()

    model_dir = str(default_model_dir())
    base = EngineConfig(model_dir=model_dir, max_batch_size=args.batch_size, dtype=auto_dtype("cpu"))
    questions = load_questions(args.dataset, args.num_prompts)
    runs: dict[str, EngineRun] = {}
    for algorithm in args.algorithm.split(","):
        spec = SpecConfig(algorithm=algorithm, **served_drafter(algorithm))
        for compiled in (False, True):
            runs[f"{algorithm} {'compiled' if compiled else 'eager'}"] = EngineRun(
                Engine(replace(base, spec=spec, cpu_compile=compiled)), args.max_new_tokens)
    tokenizer = next(iter(runs.values())).engine.tokenizer
    prompts = [tokenizer.encode(render_chat(model_dir, q), add_special_tokens=False).ids for q in questions]
    for r in runs.values():
        r.warm_up(prompts[0])
    for i in tqdm(range(0, len(prompts), args.batch_size), desc="chunks of prompts", unit="chunk"):
        for r in runs.values():
            r.run(prompts[i : i + args.batch_size])

    report: dict = {"dataset": args.dataset, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                    "batch_size": args.batch_size, "dtype": base.dtype, "hardware": describe(), "runs": {}}
    for name, r in runs.items():
        report["runs"][name] = {"tokens_per_s": round(r.tokens_per_s, 2), "accept_length": round(r.accept_length, 3),
                                "profile_ms": r.engine.profile.per_step_ms(), "shapes": r.engine.chooser.summary()}
    for algorithm in args.algorithm.split(","):
        eager, compiled = runs[f"{algorithm} eager"], runs[f"{algorithm} compiled"]
        report["runs"][f"{algorithm} compiled"] |= {
            "vs_eager": round(compiled.tokens_per_s / eager.tokens_per_s, 3),
            "same_output_fraction": sum(a == b for a, b in zip(compiled.outputs, eager.outputs)) / len(prompts),
        }
        print(f"{algorithm:8s} eager {eager.tokens_per_s:6.1f} tok/s  compiled {compiled.tokens_per_s:6.1f} tok/s"
              f"  ({compiled.tokens_per_s / eager.tokens_per_s:.2f}x)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
