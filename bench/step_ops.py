"""Where a target forward's time goes per op, eagerly, for T new tokens after a cached prefix.

    .venv/bin/python bench/step_ops.py --prefix 300 --tokens 1,2,4,8 [--load-format gguf] [--attention sdpa]

Runs `runtime.compiled.ReadOnlyForward` (what the CPU step program exports) eagerly at batch 1 on the
served model, random K/V in the prefix, and prints per T the forward's time (median of `--repeats`)
and the ops that took the most self time under torch's profiler. Eager times are not the compiled
program's (its op boundaries and overheads differ); they show which ops grow with T or with the prefix.
It does not time the compiled program (`bench/cpu_step.py` does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specserve.config import EngineConfig
from specserve.hardware import describe
from specserve.host_memory import back_with_huge_pages
from specserve.models.kv_cache import KVCache
from specserve.models.loading import load_target
from specserve.runtime.compiled import ReadOnlyForward, aligned_keys, prefix_keys
from specserve_kernels import slot_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--prefix", type=int, default=300)
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--attention", default="in_place", choices=("in_place", "sdpa"),
                   help="the step program's attention: the in-place CPU kernel, or SDPA over gathered keys")
    args = p.parse_args()
    cfg = EngineConfig(model_dir=args.model_dir, device="cpu", max_batch_size=1, max_seq_len=args.prefix + 64,
                       load_format=args.load_format)
    model = load_target(cfg).eval()
    back_with_huge_pages()  # the weights on 2 MiB pages, as the engine keeps them
    max_len = args.prefix + 80
    model.init_rope(max_len)
    cache = KVCache(model.cfg, 1, max_len, next(model.parameters()).dtype, torch.device("cpu"))
    cache.data.normal_()
    in_place = args.attention == "in_place" and slot_attention.load()
    forward = ReadOnlyForward(model, (), with_logits=True, in_place=in_place)
    kv = prefix_keys(cache, aligned_keys(args.prefix))
    rows = []
    for t in map(int, args.tokens.split(",")):
        inputs = (torch.randint(0, model.cfg.vocab_size, (1, t)), (args.prefix + torch.arange(t))[None],
                  torch.tensor([0]), torch.tensor([args.prefix]),
                  torch.tril(torch.ones(t, t, dtype=torch.bool))[None], kv)
        with torch.inference_mode():
            for _ in range(3):
                forward(*inputs)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                forward(*inputs)
                times.append(time.perf_counter() - start)
            with torch.profiler.profile() as prof:
                for _ in range(5):
                    forward(*inputs)
        ops = sorted(((e.key, e.self_cpu_time_total / 5 / 1e3) for e in prof.key_averages()), key=lambda r: -r[1])
        rows.append({"tokens": t, "forward_ms": round(statistics.median(times) * 1e3, 2),
                     "ops_ms": {k: round(v, 2) for k, v in ops[: args.top]}})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"prefix": args.prefix, "load_format": cfg.load_format, "in_place": in_place,
                      "hardware": describe(), "rows": rows}))


if __name__ == "__main__":
    main()
