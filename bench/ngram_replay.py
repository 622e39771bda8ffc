"""How far NGRAM drafting can go on a data set, without timing the engine: the target's greedy
outputs replayed through `NgramDrafter`, every tree size at every step, and the step costs
`bench/cpu_step.py` measured.

The target decodes each prompt once (compiled step program, greedy). Then, for each tree budget n
of the shape menu (1 = plain decoding), the replay drafts at every position the way a step would,
walks the tree along the tokens the target really produced (greedy acceptance) and moves on by the
accept length. Projected speed-up of the decode steps = (tokens / cost) against plain decoding's,
with a step's cost the measured forward time of its tree's node count (prefill and per-step
overheads left out). `oracle` picks, at every step, the budget with the most accepted tokens per
unit of cost, knowing the answer: no chooser can beat it with these drafts and costs.

    .venv/bin/python bench/cpu_step.py --json results/cpu_step.json
    .venv/bin/python bench/ngram_replay.py --dataset bench/grounded.jsonl --step-costs results/cpu_step.json
"""

from __future__ import annotations

import argparse
import bisect
import json
from typing import NamedTuple

import torch

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.draft_plan import DraftPlan
from specserve.drafters.ngram import NgramDrafter
from specserve.engine.engine import Engine
from specserve.prepare import default_model_dir
from specserve.prompts import load_questions, render_chat
from specserve.tree import DraftShape, DraftTree
from specserve_kernels.verify_greedy import verify_greedy


class _Sequence(NamedTuple):  # what NgramDrafter.propose reads of a request
    request_id: str
    token_ids: list[int]


def accept_length(tree: DraftTree, truth: list[int]) -> int:
    """Greedy acceptance of `tree` against the tokens that really followed (root + matched drafts),
    by the engine's own verification: the target's choice after a node at depth d is truth[d]."""
    target = torch.tensor([truth[d] if d < len(truth) else -1 for d in tree.depth.tolist()])
    result = verify_greedy(tree.tokens[None], tree.first_child[None], tree.next_sibling[None], target[None])
    return int(result.accept_length[0])


class StepCosts:
    """Forward ms by tree node count, from a `bench/cpu_step.py` JSON (the next measured size up)."""

    def __init__(self, path: str, program: str) -> None:
        rows = json.load(open(path))["rows"]
        self.sizes = [r["tokens"] for r in rows]
        self.ms = [r["forward_ms"][program] for r in rows]

    def __call__(self, num_draft_tokens: int) -> float:
        return self.ms[min(bisect.bisect_left(self.sizes, num_draft_tokens), len(self.ms) - 1)]


def replay(examples: list[tuple[list[int], list[int]]], plan: DraftPlan, costs: StepCosts,
           budgets: list[int]) -> dict[str, dict[str, float]]:
    """Per budget (and the oracle): tokens, steps, cost (ms) over all examples."""
    totals = {str(n): {"tokens": 0, "steps": 0, "ms": 0.0} for n in [*budgets, "oracle"]}
    for policy in totals:
        for k, (prompt, output) in enumerate(examples):
            drafter, rid, j = NgramDrafter(plan), f"r{k}", 1  # output[0] comes from the prefill
            while j < len(output):
                seq = prompt + output[:j]
                options = []
                for n in (budgets if policy == "oracle" else [int(policy)]):
                    tree = drafter.propose([_Sequence(rid, seq)], DraftShape(n, n - 1, 1))[0]
                    options.append((min(accept_length(tree, output[j:]), len(output) - j),
                                    costs(tree.num_draft_tokens)))
                accepted, ms = max(options, key=lambda o: o[0] / o[1])
                t = totals[policy]
                t["tokens"], t["steps"], t["ms"] = t["tokens"] + accepted, t["steps"] + 1, t["ms"] + ms
                j += accepted
    return totals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="bench/grounded.jsonl")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--step-costs", required=True, help="a bench/cpu_step.py JSON")
    p.add_argument("--program", default="few_row_gemm/in_place",
                   help="whose forward times to use (a key of cpu_step.py's forward_ms)")
    p.add_argument("--json", default="")
    args = p.parse_args()

    model_dir = default_model_dir()
    engine = Engine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32", max_queue_size=0))
    prompts = [engine.tokenizer.encode(render_chat(model_dir, q), add_special_tokens=False).ids
               for q in load_questions(args.dataset, args.num_prompts)]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=args.max_new_tokens))
    examples = [(prompt, out.token_ids) for prompt, out in zip(prompts, outputs)]

    plan = DraftPlan.of(SpecConfig(algorithm="ngram"))
    budgets = [s.num_draft_tokens for s in plan.menu]
    totals = replay(examples, plan, StepCosts(args.step_costs, args.program), budgets)
    plain = totals["1"]["tokens"] / totals["1"]["ms"]
    print(f"{args.dataset}: {len(examples)} prompts, {totals['1']['tokens']} tokens; step costs {args.step_costs}")
    print(f"{'budget':>8} {'accept length':>14} {'ms per step':>12} {'decode speed-up':>16}")
    for policy, t in totals.items():
        t["accept_length"] = round(t["tokens"] / t["steps"], 3)
        t["speedup"] = round(t["tokens"] / t["ms"] / plain, 3)
        print(f"{policy:>8} {t['accept_length']:>14.2f} {t['ms'] / t['steps']:>12.1f} {t['speedup']:>15.2f}x")
    if args.json:
        json.dump({"dataset": args.dataset, "step_costs": args.step_costs, "program": args.program, "budgets": totals},
                  open(args.json, "w"), indent=2)


if __name__ == "__main__":
    main()
