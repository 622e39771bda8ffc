"""Two versions of the CPU attention kernel (`cpu/slot_attention.cpp`) in one process, timed alternately on a
step's attention calls in SmolLM2's shapes (30 layers; 9 query heads, 3 K/V heads of 64), their outputs
compared bit for bit.

Per context length and token count t: one request's t new tokens after `--context` cached ones, as a chain
(a decode's or a verified chain's mask) or, with `--tree`, a random tree of t nodes; a float32 cache. Both
versions run in one process (`kernel_versions`: each built under its own op namespace), best of `--repeats`
alternated rounds of 30 calls.

    .venv/bin/python bench/slot_attention_ab.py --before HEAD [--after WORKTREE] [--tokens 1 8 16 24] \\
        [--context 150 400]

`--before` / `--after`: a git revision, `WORKTREE` or the path of a `.cpp` variant. Prints one line per
(context, t); exits 1 if the two versions' outputs differ in any bit. It times the op alone, not a step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from kernel_versions import build, source_text

from specserve_kernels import slot_attention

SOURCE = "kernels/specserve_kernels/cpu/slot_attention.cpp"
LAYERS, QUERY_HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def tree_mask(t: int, tree: bool, generator: torch.Generator) -> torch.Tensor:
    """(1, t, t) bool: a chain's causal mask, or a random tree's (each node sees itself and its ancestors)."""
    if not tree:
        return torch.ones(1, t, t, dtype=torch.bool).tril()
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, t)]
    mask = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        j = i
        while j >= 0:
            mask[i, j], j = True, parents[j]
    return mask[None]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", default="WORKTREE")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24])
    p.add_argument("--context", type=int, nargs="+", default=[150, 400])
    p.add_argument("--tree", action="store_true", help="random trees instead of chains")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        ops = [build(slot_attention._LIBRARY, "slot_attention", tag, source_text(SOURCE, rev), Path(tmp))
               for tag, rev in (("a", args.before), ("b", args.after))]
        cache_len = max(args.context) + max(args.tokens) + 16
        k_cache, v_cache = (torch.randn(2, KV_HEADS, cache_len, HEAD_DIM, generator=generator) for _ in range(2))
        print(f"before {args.before}, after {args.after}; {torch.get_num_threads()} threads, {LAYERS} calls a round",
              flush=True)
        for context in args.context:
            for t in args.tokens:
                q = torch.randn(1, t, QUERY_HEADS, HEAD_DIM, generator=generator)
                k_new, v_new = (torch.randn(1, t, KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
                call = (q, k_new, v_new, k_cache, v_cache, torch.tensor([1]), torch.tensor([context]),
                        tree_mask(t, args.tree, generator))
                if not torch.equal(ops[0].slot_attention(*call), ops[1].slot_attention(*call)):
                    print(f"context {context} t {t}: the two versions' outputs differ", flush=True)
                    return 1
                best = [float("inf")] * 2
                for _ in range(args.repeats):
                    for i, op in enumerate(ops):
                        start = time.perf_counter()
                        for _ in range(LAYERS):
                            op.slot_attention(*call)
                        best[i] = min(best[i], time.perf_counter() - start)
                print(f"context {context:4d} t {t:3d}: before {best[0] * 1e3:7.3f} ms   after {best[1] * 1e3:7.3f} ms"
                      f"   {best[0] / best[1]:5.2f}x   same bits", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
