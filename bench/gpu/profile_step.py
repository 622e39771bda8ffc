"""Where a GPU decode step's time goes: one shape's captured step, replayed bare and through the
runner, and torch.profiler's per-kernel device times of the same step (eager, then replayed).

    python bench/gpu/profile_step.py --shape smollm2-135m [--layers N] [--batch-size 1] [--tokens 1]

Prints the timings and the kernel tables (sorted by device time, per step) to stdout. It needs a
CUDA device (on a CPU it runs the eager step only, for the test suite); it measures, it fixes nothing.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import SHAPES, random_model, timer  # noqa: E402

from specserve.models.attention import make_attention_backend, resolve_attention  # noqa: E402
from specserve.models.kv_cache import KVCache  # noqa: E402
from specserve.runtime.cuda_graph import GraphRunner  # noqa: E402


def kernel_table(fn, steps: int, rows: int) -> str:
    """torch.profiler's table of `steps` calls of fn, device time first."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=70)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--tokens", type=int, default=1, help="tokens a request verifies (1: decode)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--attention", default="auto")
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = SHAPES[args.shape]
    if args.layers:
        cfg = replace(cfg, num_layers=args.layers)
    dtype = torch.bfloat16
    model = random_model(cfg, dtype, device)
    bs, t = args.batch_size, args.tokens
    cache = KVCache(cfg, bs + 1, args.context + t + 1, dtype, str(device))
    model.init_rope(cache.max_len)
    attention = resolve_attention(args.attention, device, dtype)
    capture = device.type == "cuda"
    runner = GraphRunner(model, cache, [bs], [t], (), padding_slot=bs, capture=capture,
                         make_backend=lambda b, n: make_attention_backend(attention, cfg, cache.max_len, dtype,
                                                                           device, b if capture else None, n))
    slots = torch.arange(bs, device=device)
    lens = torch.full((bs,), args.context, device=device)
    tokens = torch.randint(0, cfg.vocab_size, (bs, t), device=device)
    positions = lens[:, None] + torch.arange(t, device=device)
    mask = torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(bs, t, t) if t > 1 else None
    host = [args.context] * bs
    bucket = runner.buckets[(bs, t)]

    def through_runner() -> object:
        return runner.forward(tokens, positions, slots, lens, mask, host)

    eager = runner.captured_functions()[(bs, t)]  # the static forward a graph captures, run eagerly

    print(f"{args.shape} ({cfg.num_layers} layers), batch {bs} x {t} tokens, context {args.context}, "
          f"{attention} attention, {device}")
    print(f"eager step: {timer(device, eager, 10) * 1e3:.3f} ms")
    if bucket.graph is not None:
        print(f"graph replay alone: {timer(device, bucket.graph.replay, 50) * 1e3:.3f} ms")
        print(f"through the runner: {timer(device, through_runner, 50) * 1e3:.3f} ms")
    print(f"\n== eager, {args.steps} steps\n" + kernel_table(eager, args.steps, args.rows))
    if bucket.graph is not None:
        print(f"\n== graph replay, {args.steps} steps\n" + kernel_table(bucket.graph.replay, args.steps, args.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
