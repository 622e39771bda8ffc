"""Prefill with a head's catch-up at each prompt chunk against the catch-up left to the head's first
draft (`HeadDrafter.catch_up_on_prefill`, off in the hybrid), on one engine, alternated chunk by chunk.

    .venv/bin/python bench/head_prefill.py [--algorithm hybrid] [--num-prompts 80] [--batch-size 8]

Each chunk of prompts generates one token (its prefill only); the chunks alternate between the two
settings and hold different prompts, so no prefix is cached from one to the next. Prints the time per
prompt token of each setting and the CPU's flags; it does not time the drafts that follow.
"""

from __future__ import annotations

import argparse
import time

from specserve import cli
from specserve.config import SamplingParams
from specserve.engine.engine import Engine
from specserve.hardware import describe
from specserve.prompts import load_questions, render_chat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="hybrid")
    parser.add_argument("--num-prompts", type=int, default=80)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    config = cli._engine_config(cli.build_parser().parse_args(["bench", "--no-hf"]), args.algorithm, args.batch_size)
    engine = Engine(config)
    head = getattr(engine.drafter, "head", engine.drafter)
    prompts = [engine.tokenizer.encode(render_chat(config.model_dir, q), add_special_tokens=False).ids
               for q in load_questions("mtbench", args.num_prompts)]
    engine.generate(prompts[:1], [SamplingParams(max_tokens=1)])  # warm-up
    seconds, tokens = {True: 0.0, False: 0.0}, {True: 0, False: 0}
    for n, i in enumerate(range(1, len(prompts), args.batch_size)):
        at_prefill = n % 2 == 0
        head.catch_up_on_prefill = at_prefill
        chunk = prompts[i : i + args.batch_size]
        start = time.perf_counter()
        engine.generate(chunk, [SamplingParams(max_tokens=1)] * len(chunk))
        seconds[at_prefill] += time.perf_counter() - start
        tokens[at_prefill] += sum(map(len, chunk))
    print(describe())
    for at_prefill in (True, False):
        print(f"catch-up at prefill {at_prefill}: {seconds[at_prefill]:.2f} s for {tokens[at_prefill]} prompt tokens, "
              f"{1e3 * seconds[at_prefill] / tokens[at_prefill]:.3f} ms a token")


if __name__ == "__main__":
    main()
