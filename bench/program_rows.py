"""The target's two compiled programs on this CPU, per forward size: the step program (inductor's
template matmuls on AMX / AVX-512, or the few-row kernel) against the prefill program (oneDNN's
prepacked matmuls), each called directly, in the served engine's configuration (`llm_none`:
dtype auto, 8 slots x 2048 tokens), after `--context` cached tokens.

The programs come from the compile cache (compiled on first use, minutes on 2 cores). Sizes above
the step program's rows (`CompiledTarget.step_rows`) are timed on the prefill program only.

    .venv/bin/python bench/program_rows.py [--shapes 1x1 4x1 8x1 1x16 1x25 1x32 1x48 1x64 4x16] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specserve.config import EngineConfig
from specserve.engine.engine import Engine
from specserve.hardware import cpu_flags, describe
from specserve.prepare import prepare
from specserve.runtime.compiled import CompiledTarget, aligned_keys, prefix_keys

DEFAULT_SHAPES = ("1x1", "4x1", "8x1", "1x16", "1x25", "1x32", "1x48", "1x64", "4x16")


def time_program(program, compiled: CompiledTarget, b: int, t: int, context: int, repeats: int) -> float:
    """Median ms of `repeats` calls of one program on b rows of t new tokens after `context` entries."""
    g = torch.Generator().manual_seed(b * 1000 + t)
    tokens = torch.randint(100, 30000, (b, t), generator=g)
    positions = (context + torch.arange(t)).expand(b, t).contiguous()
    slots, lens = torch.arange(b), torch.full((b,), context)
    mask = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t).contiguous()
    keys = prefix_keys(compiled.cache, aligned_keys(context))
    samples = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        program(tokens, positions, slots, lens, mask, keys)
        if i:
            samples.append(time.perf_counter() - start)
    return round(statistics.median(samples) * 1e3, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="batch x tokens")
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="")
    args = p.parse_args()

    engine = Engine(EngineConfig(model_dir=str(prepare()), compiled_steps="always"))
    compiled = engine.runner.compiled
    assert compiled is not None, "no compiled programs on this machine"
    print(f"step program: {compiled.step_matmul} matmuls, up to {compiled.step_rows} rows | CPU flags:",
          " ".join(sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})))
    rows = []
    with torch.inference_mode():
        for shape in args.shapes:
            b, t = (int(x) for x in shape.split("x"))
            step = (time_program(compiled.step_runner, compiled, b, t, args.context, args.repeats)
                    if compiled.step_runner is not None and b * t <= compiled.step_rows else None)
            prefill = time_program(compiled.runner, compiled, b, t, args.context, args.repeats)
            rows.append({"batch": b, "tokens": t, "step_program_ms": step, "prefill_program_ms": prefill})
            print(f"{b} x {t:3d}: step program {step} ms, prefill program {prefill} ms", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"hardware": describe(), "cpu_flags": sorted(cpu_flags()),
                                               "context": args.context, "step_matmul": compiled.step_matmul,
                                               "step_rows": compiled.step_rows, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
