"""Resident memory of one engine under prompts of every length, in this process: rounds of 8
random prompts of 20-1,200 tokens (16 answer tokens each) for `--seconds`, the process's RSS after
each round, and its growth per minute after the first minute.

    .venv/bin/python bench/memory_growth.py [--algorithm eagle3] [--eager] [--seconds 300] [--json F]

The served drafter of the algorithm, the default dtype (bf16 where the CPU has it); `--eager`
serves without the compiled programs (`cpu_compile` off). Through Triton, `make soak` measures
the served processes instead.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specserve.config import EngineConfig, SamplingParams, spec_config
from specserve.engine.engine import Engine
from specserve.hardware import cpu_flags, describe
from specserve.prepare import prepare
from specserve.serving.repository import served_drafter


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="eagle3")
    p.add_argument("--eager", action="store_true", help="no compiled programs")
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--json", default="")
    args = p.parse_args()

    served = served_drafter(args.algorithm) or {}
    spec = spec_config({"algorithm": args.algorithm, **served})
    engine = Engine(EngineConfig(model_dir=str(prepare()), cpu_compile=not args.eager, spec=spec))
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    samples = []  # (seconds, MB)
    start = time.time()
    while time.time() - start < args.seconds:
        lengths = torch.randint(20, 1200, (8,), generator=g).tolist()
        engine.generate([torch.randint(100, 30000, (n,), generator=g).tolist() for n in lengths], params)
        samples.append((round(time.time() - start, 1), round(rss_mb(), 1)))
        print(f"{samples[-1][0]:7.1f} s {samples[-1][1]:8.1f} MB", flush=True)
    after = [s for s in samples if s[0] >= 60]
    per_min = (after[-1][1] - after[0][1]) / (after[-1][0] - after[0][0]) * 60 if len(after) > 1 else None
    print(f"after the first minute: {per_min and round(per_min, 1)} MB a minute")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"hardware": describe(), "cpu_flags": sorted(cpu_flags()),
                                               "algorithm": args.algorithm, "eager": args.eager,
                                               "samples": samples, "mb_per_min_after_60s": per_min}, indent=1))


if __name__ == "__main__":
    main()
