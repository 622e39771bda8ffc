"""How far suffix decoding can go on a data set, without timing the engine: the target's greedy outputs
replayed in order through `SuffixDrafter`, per tree budget, and the knobs' effect on what it accepts.

The target decodes each prompt once (compiled step program, greedy; cached in `--outputs`). Then for each
knob setting (`--set name=v1,v2`, the SpecConfig's suffix_* fields) and tree budget n, the replay drafts at
every position as a step would (`SuffixDrafter.propose_ranked`, the ranked tree cut to n nodes), walks the
tree along the tokens the target really produced (greedy acceptance), moves on by the accept length, and
releases each request into the shared store when its output ends, so later requests draft from it as in
service. Reported per setting and budget: accept length (tokens a step), the share of steps with a draft,
and with `--step-costs` (a `bench/cpu_step.py` JSON) the decode steps' projected speed-up over plain
decoding (prefill left out; `--overhead-ms` adds a step's host time to every step). `sized` lets the drafter
size each tree as it does in the engine (`SuffixDrafter.tree_size` on those costs, its calibration updated
as steps are verified); `best` picks at every step the budget with the most accepted tokens per unit of
cost, knowing the answer: what a perfect size chooser would reach. `oracle` bounds every drafter that draws
on these stores: at every step, of the continuations after the longest match (its own text's and the shared
store's, as the drafter weighs them), the one that agrees longest with the target's tokens, drafted alone as
a chain of exactly the tokens it gets accepted (at most the largest budget's depth).

    .venv/bin/python bench/suffix_replay.py --dataset bench/repetitive.jsonl --num-prompts 120 \\
        --step-costs results/cpu_step.json --set suffix_max_spec_factor=1,2,4

It does not time drafting or verification (`bench/suffix_store.py` times the drafter).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from dataclasses import replace
from typing import NamedTuple

from ngram_replay import StepCosts, accept_length

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.draft_plan import DraftPlan
from specserve.drafters.suffix import SuffixDrafter, TokenStore
from specserve.engine.engine import Engine
from specserve.prepare import default_model_dir
from specserve.prompts import load_questions, render_chat


class _Sequence(NamedTuple):  # what SuffixDrafter reads of a request
    request_id: str
    token_ids: list[int]
    cache_salt: str | None = None


def greedy_outputs(dataset: str, num_prompts: int, max_new_tokens: int, path: str) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy output) per prompt, decoded once and kept in `path`."""
    key = {"dataset": dataset, "num_prompts": num_prompts, "max_new_tokens": max_new_tokens}
    if path and os.path.exists(path):
        saved = json.load(open(path))
        if saved["key"] == key:
            return [tuple(e) for e in saved["examples"]]
    model_dir = default_model_dir()
    engine = Engine(EngineConfig(model_dir=model_dir, device="cpu", max_queue_size=0))
    prompts = [engine.tokenizer.encode(render_chat(model_dir, q), add_special_tokens=False).ids
               for q in load_questions(dataset, num_prompts)]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_new_tokens))
    examples = [(p, o.token_ids) for p, o in zip(prompts, outputs)]
    if path:
        json.dump({"key": key, "examples": examples}, open(path, "w"))
    return examples


def replay(examples: list[tuple[list[int], list[int]]], spec: SpecConfig, budgets: list[int],
           costs: StepCosts | None, overhead_ms: float = 0.0) -> dict[str, dict[str, float]]:
    """Per budget (with costs also `sized` and `best`): tokens, steps, drafting steps and cost (ms) over the
    stream, each step `overhead_ms` more than its forward."""
    policies = [str(n) for n in budgets] + (["sized", "best"] if costs else [])
    totals = {p: {"tokens": 0, "steps": 0, "drafting": 0, "ms": 0.0} for p in policies + ["oracle"]}
    oracle(examples, spec, max(budgets), costs, overhead_ms, totals["oracle"])
    for policy in policies:
        drafter = SuffixDrafter(DraftPlan.of(replace(spec, num_draft_tokens=max(budgets))))
        if costs:  # what the engine gives the drafter: each node count's step time
            drafter.step_cost = lambda batch, most: [costs(n) + overhead_ms for n in range(1, most + 1)]
        for k, (prompt, output) in enumerate(examples):
            rid, j = f"r{k}", 1  # output[0] comes from the prefill
            while j < len(output):
                seq = _Sequence(rid, prompt + output[:j])
                options = []
                if policy == "sized":  # the drafter's own size (`SuffixDrafter.tree_size`), calibrated as it goes
                    trees = [drafter.propose([seq])[0]]
                else:
                    sizes = budgets if policy == "best" else [int(policy)]
                    trees = [drafter.propose_ranked(seq, n)[0] for n in sizes]
                for tree in trees:
                    accepted = min(accept_length(tree, output[j:]), len(output) - j)
                    ms = (costs(tree.num_draft_tokens) if costs else 1.0) + overhead_ms
                    options.append((accepted, ms, tree.num_draft_tokens))
                accepted, ms, size = max(options, key=lambda o: o[0] / o[1])
                if policy == "sized":
                    drafter.on_accept([seq], None, [range(accepted)])  # the root and the accepted drafts
                t = totals[policy]
                t["tokens"] += accepted
                t["steps"] += 1
                t["drafting"] += size > 1
                t["ms"] += ms
                j += accepted
            drafter.on_accept([_Sequence(rid, prompt + output)], None, [])  # its last tokens, as a finished request's
            drafter.release(rid)
    return totals


def oracle(examples: list[tuple[list[int], list[int]]], spec: SpecConfig, budget: int, costs: StepCosts | None,
           overhead_ms: float, total: dict[str, float]) -> None:
    """The `oracle` policy's tokens, steps, drafting steps and cost, added to `total`: each step drafts the
    one continuation after the longest match that agrees longest with what the target wrote."""
    k, depth = spec.suffix_min_match, min(spec.suffix_max_depth, budget - 1)
    shared = TokenStore(spec.suffix_cache_tokens, k, ring=True)
    for prompt, output in examples:
        own = TokenStore(max(2, 2 * (len(prompt) + len(output))), k, ring=False)
        own.append(prompt + output[:1])
        j = 1
        while j < len(output):
            context, truth, agreed = own.buf[: own.high], output[j:], 0
            for store in (own, shared):
                length, at = store.match(context, spec.suffix_max_depth)
                if length and depth:
                    for row in store.continuations(at, depth).tolist():
                        agreed = max(agreed, next((i for i, (a, b) in enumerate(zip(row, truth)) if a != b),
                                                  min(len(row), len(truth))))
            accepted = min(1 + agreed, len(output) - j)
            total["tokens"] += accepted
            total["steps"] += 1
            total["drafting"] += agreed > 0
            total["ms"] += (costs(accepted) if costs else 1.0) + overhead_ms
            own.append(output[j: j + accepted])
            j += accepted
        shared.append(prompt + output)
        shared.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="bench/repetitive.jsonl")
    p.add_argument("--num-prompts", type=int, default=120)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budgets", default="1,4,8,12,16,24")
    p.add_argument("--step-costs", default="", help="a bench/cpu_step.py JSON (projected speed-ups)")
    p.add_argument("--program", default="few_row_gemm/in_place",
                   help="whose forward times to use (a key of cpu_step.py's forward_ms)")
    p.add_argument("--outputs", default="results/suffix_replay_outputs.json", help="greedy outputs kept here")
    p.add_argument("--set", action="append", default=[], help="name=v1,v2: a suffix_* knob's values to compare")
    p.add_argument("--overhead-ms", type=float, default=0.0,
                   help="a step's host time beside its forward (the bench profile's total - forward), every step")
    p.add_argument("--json", default="")
    args = p.parse_args()

    examples = greedy_outputs(args.dataset, args.num_prompts, args.max_new_tokens, args.outputs)
    costs = StepCosts(args.step_costs, args.program) if args.step_costs else None
    budgets = [int(b) for b in args.budgets.split(",")]
    grid = [(name, [type(getattr(SpecConfig(), name))(v) for v in values.split(",")])
            for name, values in (s.split("=", 1) for s in args.set)]
    rows = []
    print(f"{args.dataset}: {len(examples)} prompts, {sum(len(o) for _, o in examples)} output tokens")
    for combo in itertools.product(*[values for _, values in grid]):
        knobs = dict(zip([name for name, _ in grid], combo))
        spec = replace(SpecConfig(algorithm="suffix"), **knobs)
        totals = replay(examples, spec, budgets, costs, args.overhead_ms)
        plain = totals["1"]["tokens"] / totals["1"]["ms"]
        for policy, t in totals.items():
            row = {**knobs, "budget": policy, "accept_length": round(t["tokens"] / t["steps"], 3),
                   "drafting_share": round(t["drafting"] / t["steps"], 3)}
            if costs:
                row["speedup"] = round(t["tokens"] / t["ms"] / plain, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        json.dump({"dataset": args.dataset, "num_prompts": len(examples), "step_costs": args.step_costs,
                   "rows": rows}, open(args.json, "w"), indent=2)


if __name__ == "__main__":
    main()
