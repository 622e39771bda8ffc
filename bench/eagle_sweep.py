"""Acceptance and speed of the committed EAGLE / MTP drafters as topk and num_draft_tokens vary.

    .venv/bin/python bench/eagle_sweep.py --out results/eagle_sweep [--algorithms eagle3,eagle]

For each algorithm and each (topk, num_draft_tokens) on the grid (num_steps fixed; topk=1 is the
chain of num_steps + 1 tokens) it runs MT-bench first turns at batch 1, greedy, and records the
accept length and tokens/s; writes <out>.json and a two-panel <out>.png.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from specserve.bench import run_engine
from specserve.config import EngineConfig, SpecConfig
from specserve.engine.engine import Engine
from specserve.prepare import default_model_dir
from specserve.prompts import load_questions, render_chat
from specserve.serving.repository import served_drafter


def spec_for(algorithm: str, num_steps: int, topk: int, num_draft_tokens: int) -> SpecConfig:
    return SpecConfig(algorithm=algorithm, num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens,
                      **served_drafter(algorithm))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/eagle_sweep")
    ap.add_argument("--algorithms", default="eagle3,eagle")
    ap.add_argument("--num-steps", type=int, default=5)
    ap.add_argument("--topk", default="1,2,4,8")
    ap.add_argument("--num-draft-tokens", default="4,8,16")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    config = EngineConfig(model_dir=str(default_model_dir()), device="cpu", dtype="bfloat16", cpu_compile=False,
                          max_batch_size=1, max_seq_len=2048, max_queue_size=0)
    base = Engine(config)
    prompts = [base.tokenizer.encode(render_chat(config.model_dir, q), add_special_tokens=False).ids
               for q in load_questions("mtbench", args.num_prompts)]
    none = run_engine(base, prompts, args.max_new_tokens)
    del base
    rows = []
    for algorithm in args.algorithms.split(","):
        for topk in map(int, args.topk.split(",")):
            sizes = [args.num_steps + 1] if topk == 1 else [int(n) for n in args.num_draft_tokens.split(",")]
            for n in sizes:
                spec = spec_for(algorithm, args.num_steps, topk, n)
                run = run_engine(Engine(replace(config, spec=spec)), prompts, args.max_new_tokens)
                rows.append({"algorithm": algorithm, "num_steps": args.num_steps, "topk": topk, "num_draft_tokens": n,
                             "accept_length": round(run["accept_length"], 3),
                             "tokens_per_s": round(run["tokens_per_s"], 2),
                             "speedup": round(run["tokens_per_s"] / none["tokens_per_s"], 3),
                             "lossless": run["outputs"] == none["outputs"]})
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"none_tokens_per_s": round(none["tokens_per_s"], 2), "num_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, algorithm in enumerate(sorted({r["algorithm"] for r in rows})):
        for topk in sorted({r["topk"] for r in rows if r["algorithm"] == algorithm}):
            pts = sorted((r["num_draft_tokens"], r["accept_length"], r["speedup"]) for r in rows
                         if r["algorithm"] == algorithm and r["topk"] == topk)
            x = [p[0] for p in pts]
            style = ("o-", "s--", "^:")[i % 3]
            axes[0].plot(x, [p[1] for p in pts], style, label=f"{algorithm} topk={topk}")
            axes[1].plot(x, [p[2] for p in pts], style, label=f"{algorithm} topk={topk}")
    axes[0].set(xlabel="num_draft_tokens (tree size)", ylabel="accept length", xscale="log", title="acceptance")
    axes[1].set(xlabel="num_draft_tokens (tree size)", ylabel="speedup over none", xscale="log", title="speed")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
