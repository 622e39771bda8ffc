"""Every drafting method's greedy token ids and accept lengths on MT-bench, saved or compared.

    .venv/bin/python bench/greedy_ids.py --out results/greedy_ids.json          # save
    .venv/bin/python bench/greedy_ids.py --compare results/greedy_ids.json      # exit 1 on a difference

What a change that must not alter behaviour is checked against: the embedded SmolLM2 in float32,
eager forwards (no compiled program: which path a step takes depends on timings), each method with
its default tree shape pinned (no adaptive choice: that too depends on timings), the draft heads'
float32 output layer kept (the int8 one is picked by timing) and the drafters the served variants
use, prompts in batches of `--batch-size`. Both the ids and each request's
accept length must be equal: the first says the output is the target's, the second that the
drafts are the same. It measures no speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def greedy_ids(algorithms: list[str], num_prompts: int, max_new_tokens: int, batch_size: int) -> dict:
    import specserve.models.eagle_head as eagle_model
    import specserve.models.mtp_head as mtp_model
    from specserve.config import EngineConfig, SamplingParams, SpecConfig
    from specserve.engine.engine import Engine
    from specserve.prepare import default_model_dir
    from specserve.prompts import render_chat
    from specserve.serving.repository import served_drafter
    from specserve_client.datasets import load_questions

    for module in (eagle_model, mtp_model):  # no timed choice of the heads' output layer
        module.fastest_logits_layer = lambda weight, rows=(1, 4): None
    model_dir = str(default_model_dir())
    params = SamplingParams(max_tokens=max_new_tokens)
    report: dict = {"num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "batch_size": batch_size, "runs": {}}
    prompts = None
    for algorithm in algorithms:
        served = served_drafter(algorithm) or {}
        spec = SpecConfig(algorithm=algorithm, adaptive=False, drafter_path=served.get("drafter_path", ""),
                          token_map=served.get("token_map"))
        engine = Engine(EngineConfig(model_dir=model_dir, dtype="float32", cpu_compile=False, max_batch_size=batch_size,
                                     spec=spec))
        if prompts is None:
            prompts = [engine.tokenizer.encode(render_chat(model_dir, q), add_special_tokens=False).ids
                       for q in load_questions("mtbench", num_prompts)]
        outs = []
        for i in range(0, len(prompts), batch_size):
            outs += engine.generate(prompts[i : i + batch_size], params)
        report["runs"][algorithm] = [{"token_ids": o.token_ids, "accept_length": round(o.accept_length, 6)}
                                     for o in outs]
        print(f"{algorithm}: {sum(len(o.token_ids) for o in outs)} tokens, accept length "
              f"{sum(o.accept_length for o in outs) / len(outs):.3f}", flush=True)
        del engine
    return report


def differences(before: dict, after: dict) -> list[str]:
    found = []
    for algorithm, runs in before["runs"].items():
        for i, (a, b) in enumerate(zip(runs, after["runs"].get(algorithm, []), strict=False)):
            for key in ("token_ids", "accept_length"):
                if a[key] != b[key]:
                    found.append(f"{algorithm} prompt {i}: {key} differs")
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="none,ngram,eagle,eagle3,mtp,standalone")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--out", type=Path, help="write the ids here")
    p.add_argument("--compare", type=Path, help="compare with ids saved earlier (same settings)")
    args = p.parse_args(argv)
    if args.compare:
        saved = json.loads(args.compare.read_text())
        args.algorithm = ",".join(saved["runs"])
        args.num_prompts, args.max_new_tokens, args.batch_size = (saved["num_prompts"], saved["max_new_tokens"],
                                                                  saved["batch_size"])
    report = greedy_ids(args.algorithm.split(","), args.num_prompts, args.max_new_tokens, args.batch_size)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report) + "\n")
    if args.compare:
        found = differences(saved, report)
        print("\n".join(found) if found else f"equal: {', '.join(saved['runs'])}")
        return 1 if found else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
