"""The target's compiled step program on this CPU: its forward time per step size (1-16 rows), side
by side for each `step_matmul` (the AVX2 few-row kernel against inductor's autotuned matmuls) and
`step_attention` (the in-place kernel against SDPA over gathered keys), interleaved in one process;
and how far their logits differ from each other.

Both programs come from the compile cache (compiled on first use, ~2 minutes each on 2 cores).
A step of t rows here is one request verifying a t-token chain after `--context` cached tokens,
as a decode (t = 1) or a tree verification does. The weights and programs are put on 2 MiB pages first,
as the engine puts them (without, a decode's TLB misses cost about a third more on a 2-core Zen 4).

    .venv/bin/python bench/cpu_step.py [--tokens 1 2 4 8 16] [--repeats 15] [--json results/cpu_step.json]
    .venv/bin/python bench/cpu_step.py --load-format gguf --matmuls auto --attention sdpa,auto  # the attention
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specserve.config import EngineConfig
from specserve.hardware import cpu_flags, describe
from specserve.host_memory import back_with_huge_pages
from specserve.models.kv_cache import KVCache
from specserve.models.loading import load_target
from specserve.prepare import default_model_dir
from specserve.runtime.compiled import CompiledTarget


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--matmuls", default="inductor,auto", help="comma-separated step_matmul values")
    p.add_argument("--attention", default="auto", help="comma-separated step_attention values (auto, sdpa)")
    p.add_argument("--load-format", default="safetensors", help="gguf: the GGUF's blocks (its kernel's matmuls)")
    p.add_argument("--json", default="")
    args = p.parse_args()

    config = EngineConfig(model_dir=default_model_dir(), load_format=args.load_format, dtype="float32")
    model = load_target(config).eval()
    cache = KVCache(model.cfg, 1, 1024 + 64, torch.float32, "cpu")
    model.init_rope(cache.max_len)
    programs = {f"{m}/{a}": CompiledTarget(model, cache, (), 1, 1024, config.compile_cache_path, m, a)
                for m in args.matmuls.split(",") for a in args.attention.split(",")}
    names = {k: f"{prog.step_matmul}/{prog.step_attention}" for k, prog in programs.items()}
    collapsed = back_with_huge_pages()  # as the engine does: a step streams every weight (4.4 -> 6.5 ms without)
    print(f"weights and programs on 2 MiB pages: {collapsed >> 20} MiB")
    print("programs:", names, "| CPU flags:", " ".join(sorted(cpu_flags() & {"avx2", "fma", "avx512f", "avx512_bf16"})))
    with torch.inference_mode():
        rows = time_steps(programs, names, model.cfg.vocab_size, args)
    write_json(rows, args)


def time_steps(programs: dict[str, CompiledTarget], names: dict[str, str], vocab: int, args: argparse.Namespace
               ) -> list[dict]:
    slots, lens = torch.zeros(1, dtype=torch.int64), torch.full((1,), args.context)
    rows = []
    for t in args.tokens:
        tokens = torch.randint(0, vocab, (1, t))
        positions = args.context + torch.arange(t)[None]
        mask = torch.ones(1, t, t, dtype=torch.bool).tril()
        samples: dict[str, list[float]] = {m: [] for m in programs}
        logits = {}
        for i in range(args.repeats + 2):
            for m, prog in programs.items():
                start = time.perf_counter()
                logits[m] = prog.forward(tokens, positions, slots, lens, mask, [args.context]).logits
                if i >= 2:
                    samples[m].append(time.perf_counter() - start)
        ms = {names[m]: round(statistics.median(s) * 1e3, 2) for m, s in samples.items()}
        ref = next(iter(logits.values()))
        diff = max((v - ref).abs().max().item() for v in logits.values())
        rows.append({"tokens": t, "forward_ms": ms, "max_logit_diff": diff})
        print(f"t={t:2d} " + "  ".join(f"{k} {v:6.2f} ms" for k, v in ms.items()) + f"  max |logit diff| {diff:.1e}",
              flush=True)
    return rows


def write_json(rows: list[dict], args: argparse.Namespace) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"hardware": describe(), "cpu_flags": sorted(cpu_flags()),
                                               "context": args.context, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
