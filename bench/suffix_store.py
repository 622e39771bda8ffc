"""Suffix decoding's host cost per decode step, the Python token store against the C++ one
(`specserve_kernels.suffix_store`), alternately in one process, on a synthetic batch.

A batch of running requests (8) drafts every step (`SuffixDrafter.propose_scored`: its own store and the
shared one matched, continuations, the draft tree), then gains 2-4 tokens (`on_accept`); a request whose
text runs out (about 128 steps) is released into the shared store (a ring of 100000 tokens, filled first
with about 200 earlier requests) and the next one starts. The text: `repetitive.jsonl`'s prompts (templated,
repetitive), a few of one family per request, split into words and punctuation with synthetic token ids.
Both paths see the same stream; their trees are checked to be the same.

Reports the median over rounds of ms per step (propose and update apart), as JSON. It times the drafter
alone: no model, no verification (the stream's tokens do not depend on the drafts).

    .venv/bin/python bench/suffix_store.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from specserve.config import SpecConfig
from specserve.draft_plan import DraftPlan
from specserve.drafters.suffix import SuffixDrafter

DATA = Path(__file__).with_name("repetitive.jsonl")
FALLBACK = ["Extract the name and city from: {} met {} in {} on {}. Answer: {{\"name\": \"{}\", \"city\": \"{}\"}}",
            "Classify the review: the {} was {} and the {} {}. Sentiment: {}, because the {} was {}."]
WORDS = "alice bob paris rome food staff room good bad late early clean noisy 2024 2025 march may".split()


@dataclass
class Seq:  # what the drafter reads of a request
    request_id: str
    token_ids: list[int]
    cache_salt: str | None = None
    slot: int = 0
    cache_len: int = 0


def texts(seed: int) -> dict[str, list[str]]:
    """Prompts by family: `repetitive.jsonl`'s, or templated ones where it is missing."""
    if DATA.exists():
        by_family: dict[str, list[str]] = {}
        for line in DATA.read_text().splitlines():
            row = json.loads(line)
            by_family.setdefault(row.get("family", ""), []).append(row["prompt"])
        return by_family
    rng = random.Random(seed)
    return {str(i): [t.format(*(rng.choice(WORDS) for _ in range(8))) for _ in range(60)]
            for i, t in enumerate(FALLBACK)}


class Stream:
    """Requests as token ids: a prompt, then the rest of their text 2-4 tokens per step."""

    def __init__(self, seed: int, per_request: int, prompt_tokens: int) -> None:
        self.rng = random.Random(seed)
        self.by_family = list(texts(seed).values())
        self.ids: dict[str, int] = {}
        self.per_request, self.prompt_tokens, self.served = per_request, prompt_tokens, 0

    def tokenize(self, text: str) -> list[int]:
        return [self.ids.setdefault(w, len(self.ids) + 3) for w in re.findall(r"\w+|[^\w\s]", text)]

    def request(self) -> tuple[Seq, list[int]]:
        """(a new request with its prompt, the tokens it will generate)."""
        family = self.rng.choice(self.by_family)
        tokens = [t for _ in range(self.per_request) for t in self.tokenize(self.rng.choice(family))]
        self.served += 1
        n = min(self.prompt_tokens, len(tokens) // 3)
        return Seq(f"r{self.served}", tokens[:n]), tokens[n:]

    def step(self) -> int:
        return self.rng.randint(2, 4)


def run(native: bool, args: argparse.Namespace, trees: list[list[int]] | None) -> dict[str, float]:
    """One round of one path: fill the shared store, warm up, then time `args.steps` steps."""
    spec = SpecConfig(algorithm="suffix", suffix_cache_tokens=args.cache_tokens)
    drafter = SuffixDrafter(DraftPlan.of(spec), native=native)
    stream = Stream(args.seed, args.texts_per_request, args.prompt_tokens)
    for _ in range(args.prefill_requests):
        seq, rest = stream.request()
        seq.token_ids = seq.token_ids + rest
        drafter.on_accept([seq], None, None)
        drafter.release(seq.request_id)
    running = [stream.request() for _ in range(args.batch)]
    propose = update = 0.0
    for step in range(args.warmup + args.steps):
        timed = step >= args.warmup
        seqs = [seq for seq, _ in running]
        t0 = time.perf_counter()
        drafted = [drafter.propose_scored(seq, args.num_draft_tokens)[0] for seq in seqs]
        t1 = time.perf_counter()
        finished = []
        for i, (seq, rest) in enumerate(running):  # the step's accepted tokens (bookkeeping, not timed)
            n = stream.step()
            seq.token_ids = seq.token_ids + rest[:n]
            running[i] = (seq, rest[n:])
            if not rest[n:]:
                finished.append(i)
        t2 = time.perf_counter()
        drafter.on_accept(seqs, None, None)
        for i in finished:
            drafter.release(running[i][0].request_id)
        t3 = time.perf_counter()
        for i in finished:
            running[i] = stream.request()
        if timed:
            propose, update = propose + t1 - t0, update + t3 - t2
            if trees is not None:
                trees.append([t for tree in drafted for t in tree.tokens.tolist()])
    return {"propose_ms": 1e3 * propose / args.steps, "update_ms": 1e3 * update / args.steps,
            "ms_per_step": 1e3 * (propose + update) / args.steps, "cached_tokens": drafter.cached_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=512, help="timed steps per round and path")
    parser.add_argument("--warmup", type=int, default=128, help="untimed steps first (requests staggered)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--num-draft-tokens", type=int, default=24, help="tree size asked for (the root included)")
    parser.add_argument("--cache-tokens", type=int, default=100_000, help="the shared ring's capacity")
    parser.add_argument("--prefill-requests", type=int, default=200, help="requests in the shared store first")
    parser.add_argument("--texts-per-request", type=int, default=4, help="prompts of one family per request")
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--step-ms", type=float, default=9.6, help="a decode step, for the share of it reported")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    trees: dict[bool, list[list[int]]] = {False: [], True: []}
    rounds: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for r in range(args.rounds):
        for native in ((False, True) if r % 2 == 0 else (True, False)):  # ABBA: drift falls on both
            rounds[native].append(run(native, args, trees[native] if r == 0 else None))
    if trees[False] != trees[True]:
        raise SystemExit("suffix_store bench: the two paths drafted different trees")

    def summary(native: bool) -> dict[str, float]:
        out = {key: statistics.median(x[key] for x in rounds[native]) for key in ("ms_per_step", "propose_ms",
                                                                                  "update_ms")}
        out["share_of_step"] = out["ms_per_step"] / args.step_ms
        return out

    python, native = summary(False), summary(True)
    drafted = sum(len(t) for t in trees[True]) / max(1, len(trees[True])) / args.batch - 1
    print(json.dumps({"python": python, "native": native, "speedup": python["ms_per_step"] / native["ms_per_step"],
                      "same_trees": True, "mean_draft_tokens_per_request": drafted,
                      "cached_tokens": rounds[True][0]["cached_tokens"], "rounds": args.rounds, "steps": args.steps,
                      "batch": args.batch, "num_draft_tokens": args.num_draft_tokens,
                      "cache_tokens": args.cache_tokens, "prefill_requests": args.prefill_requests,
                      "step_ms": args.step_ms}, indent=2))


if __name__ == "__main__":
    main()
