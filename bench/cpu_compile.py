"""Eager against compiled (AOTInductor) forwards on the CPU, side by side on the same prompts.

For each algorithm, one engine per mode runs every chunk of prompts in turn (interleaved, as
`specserve bench` runs its engines), greedy, served defaults. Modes: `eager` (`cpu_compile` off),
`onednn` (compiled, but every target forward through the prefill program: oneDNN's matmuls at
every size), `inductor` (compiled, the few-row programs' matmuls autotuned by inductor) and
`compiled` (as served: steps of a few rows through the step program, whose matmuls are the AVX2
few-row kernel in float32 where it runs, else inductor's). The JSON gives each engine's tokens per second, its ratio to
the first mode, whether their outputs are the same, and where step time goes (`StepProfile`).
Compiled programs come from the compile cache (compiled on first use).

    .venv/bin/python bench/cpu_compile.py --algorithm none,eagle,mtp --modes onednn,compiled --dataset mtbench \
        --num-prompts 12 --max-new-tokens 128 --json results/cpu_compile.json
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
    p.add_argument("--modes", default="eager,compiled", help="comma-separated: eager, onednn, inductor, compiled")
    p.add_argument("--json", default="results/cpu_compile.json")
    args = p.parse_args()

    model_dir = str(default_model_dir())
    base = EngineConfig(model_dir=model_dir, max_batch_size=args.batch_size, dtype=auto_dtype("cpu"))
    questions = load_questions(args.dataset, args.num_prompts)
    modes = args.modes.split(",")
    runs: dict[str, EngineRun] = {}
    for algorithm in args.algorithm.split(","):
        spec = SpecConfig(algorithm=algorithm, **served_drafter(algorithm))
        for mode in modes:
            engine = Engine(replace(base, spec=spec, cpu_compile=mode != "eager",
                                    step_matmul="inductor" if mode == "inductor" else "auto"))
            if mode == "onednn" and engine.runner.compiled is not None:
                engine.runner.compiled.step_runner = None  # every target forward through the prefill program
            runs[f"{algorithm} {mode}"] = EngineRun(engine, args.max_new_tokens)
    tokenizer = next(iter(runs.values())).engine.tokenizer
    prompts = [tokenizer.encode(render_chat(model_dir, q), add_special_tokens=False).ids for q in questions]
    for r in runs.values():
        r.warm_up(prompts[0])
    for i in tqdm(range(0, len(prompts), args.batch_size), desc="chunks of prompts", unit="chunk"):
        for r in runs.values():
            r.run(prompts[i : i + args.batch_size])

    report: dict = {"modes": modes, "dataset": args.dataset, "num_prompts": len(prompts),
                    "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "dtype": base.dtype,
                    "hardware": describe(), "runs": {}}
    for name, r in runs.items():
        report["runs"][name] = {"tokens_per_s": round(r.tokens_per_s, 2), "accept_length": round(r.accept_length, 3),
                                "profile_ms": r.engine.profile.per_step_ms(), "shapes": r.engine.chooser.summary(),
                                "step_matmul": getattr(r.engine.runner.compiled, "step_matmul", None),
                                "step_paths": r.engine.runner.paths.summary()}
    for algorithm in args.algorithm.split(","):
        first = runs[f"{algorithm} {modes[0]}"]
        line = f"{algorithm:8s} {modes[0]} {first.tokens_per_s:6.1f} tok/s"
        for mode in modes[1:]:
            r = runs[f"{algorithm} {mode}"]
            report["runs"][f"{algorithm} {mode}"] |= {
                f"vs_{modes[0]}": round(r.tokens_per_s / first.tokens_per_s, 3),
                "same_output_fraction": sum(a == b for a, b in zip(r.outputs, first.outputs)) / len(prompts),
            }
            line += f"  {mode} {r.tokens_per_s:6.1f} tok/s ({r.tokens_per_s / first.tokens_per_s:.2f}x)"
        print(line)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
