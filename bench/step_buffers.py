"""The target's compiled step with glibc's default allocator thresholds against the fixed ones
(`specserve.host_memory.keep_freed_memory`, which every CPU engine applies), alternated in fresh
processes: each step's gathered keys and values are either reused from the heap or mapped and
zero-filled anew (the page faults are counted too).

    .venv/bin/python bench/step_buffers.py [--batch-size 8] [--tokens 1] [--context 256] [--runs 2]

Each process builds an `Engine` (algorithm none, the compile cache's programs) and times
`--seconds` of back-to-back steps of `--batch-size` requests verifying `--tokens` tokens after
`--context` cached ones.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one_process(mode: str, batch: int, tokens: int, context: int, seconds: float) -> dict:
    import torch

    from specserve.config import EngineConfig, SpecConfig
    from specserve.engine import engine as engine_module
    from specserve.prepare import default_model_dir

    if mode == "default":  # the engine would fix the thresholds: leave glibc's own
        engine_module.keep_freed_memory = lambda: False
    config = EngineConfig(model_dir=str(default_model_dir()), max_batch_size=batch, dtype="float32",
                          cpu_compile=True, compiled_steps="always", spec=SpecConfig(algorithm="none"))
    engine = engine_module.Engine(config)
    tok = torch.randint(0, engine.model_config.vocab_size, (batch, tokens))
    slots, lens = torch.arange(batch), torch.full((batch,), context)
    positions = lens[:, None] + torch.arange(tokens)
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril().expand(batch, tokens, tokens)

    def step() -> None:
        engine.runner.compiled.forward(tok, positions, slots, lens, mask, [context] * batch)

    with torch.inference_mode():
        for _ in range(5):
            step()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            step()
            n += 1
        elapsed = time.perf_counter() - start
    return {"mode": mode, "step_ms": round(elapsed / n * 1e3, 2),
            "page_faults_per_step": round((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / n)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--runs", type=int, default=2, help="processes per mode, alternated")
    p.add_argument("--child", choices=["default", "kept"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(one_process(args.child, args.batch_size, args.tokens, args.context, args.seconds)))
        return
    shape = ["--batch-size", str(args.batch_size), "--tokens", str(args.tokens), "--context", str(args.context),
             "--seconds", str(args.seconds)]
    for _ in range(args.runs):
        for mode in ("default", "kept"):
            out = subprocess.run([sys.executable, __file__, *shape, "--child", mode], capture_output=True, text=True,
                                 check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps({"batch_size": args.batch_size, "tokens": args.tokens, "context": args.context, **row}),
                  flush=True)


if __name__ == "__main__":
    main()
