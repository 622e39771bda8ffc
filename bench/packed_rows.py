"""A batch of trees of different sizes through the target's compiled step program, padded against packed:
every request's tree padded to the largest (B x T rows) or its real nodes only (`CompiledTarget.forward`'s
num_nodes), timed alternately in one process (median of `--repeats`), on the served GGUF target.

    .venv/bin/python bench/packed_rows.py [--context 200] [--nodes 4,1,1,1,1,1,1,1 4,4,1,1,1,1,1,1 6,4,2,1]

Each `--nodes` is one batch: a chain of that many tokens per request after `--context` cached tokens.
It does not check the numbers (`tests/unit/test_compiled.py` does).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve.config import EngineConfig
from specserve.hardware import cpu_flags
from specserve.host_memory import back_with_huge_pages, keep_freed_memory
from specserve.models.kv_cache import KVCache
from specserve.models.loading import load_target
from specserve.prepare import default_model_dir
from specserve.runtime.compiled import CompiledTarget


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--nodes", nargs="+", default=["4,1,1,1,1,1,1,1", "4,4,1,1,1,1,1,1", "2,2,2,2,2,2,2,2", "6,4,2,1"])
    args = p.parse_args()
    keep_freed_memory()
    config = EngineConfig(model_dir=default_model_dir(), load_format="gguf", dtype="float32")
    model = load_target(config).eval()
    cache = KVCache(model.cfg, 8, 2112, torch.float32, "cpu")
    model.init_rope(cache.max_len)
    program = CompiledTarget(model, cache, (), 8, 2048, config.compile_cache_path)
    back_with_huge_pages()
    print("step attention:", program.step_attention, "| CPU flags:",
          " ".join(sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8"})))
    with torch.inference_mode():
        for spec in args.nodes:
            nodes = [int(n) for n in spec.split(",")]
            b, t = len(nodes), max(nodes)
            tokens = torch.randint(0, model.cfg.vocab_size, (b, t))
            positions = (args.context + torch.arange(t)).expand(b, t).contiguous()
            mask = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t).contiguous()
            slots, lens = torch.arange(b), torch.full((b,), args.context)
            runs = {"padded": None, "packed": nodes}
            times: dict[str, list[float]] = {k: [] for k in runs}
            for i in range(args.repeats + 2):
                for name, num_nodes in runs.items():
                    start = time.perf_counter()
                    program.forward(tokens, positions, slots, lens, mask, [args.context] * b, num_nodes=num_nodes)
                    if i >= 2:
                        times[name].append(time.perf_counter() - start)
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"nodes {spec:>18}: {b * t:3d} rows padded {ms['padded']:7.2f} ms, {sum(nodes):3d} packed "
                  f"{ms['packed']:7.2f} ms ({ms['padded'] / ms['packed']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
