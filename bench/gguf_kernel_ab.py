"""Two versions of the GGUF-block kernel (`cpu/gguf_gemm.cpp`) in one process, timed alternately on SmolLM2's
121 matrices (float layout, or `--layout int`), their outputs compared bit for bit.

Both versions run in one process (`kernel_versions`: each built under its own op namespace), best of
`--repeats` alternated rounds per row count.

    .venv/bin/python bench/gguf_kernel_ab.py --before HEAD~1 [--after WORKTREE] [--tokens 1 4 8 16 45]

`--before` / `--after`: a git revision of this repository (the file as committed there), `WORKTREE` (the file
as it is now) or the path of a `.cpp` file (a variant). `--digits 1` times the served 8-bit activations. Prints
one line per row count; exits 1 if the two versions' outputs differ in any bit.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from kernel_versions import build, source_text

from specserve_kernels import gguf_gemm

SOURCE = "kernels/specserve_kernels/cpu/gguf_gemm.cpp"


def main() -> int:
    from specserve.host_memory import back_with_huge_pages
    from specserve.models.gguf import load_llama_gguf
    from specserve.prepare import prepare
    from specserve_kernels.gguf_gemm import FLOAT_LAYOUT, INT_LAYOUT, GGUFLinear

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default="WORKTREE")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 5, 8, 12, 16, 45, 128])
    parser.add_argument("--layout", choices=["float", "int"], default="float")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--digits", type=int, choices=[1, 2, 3], default=3,
                        help="the integer layout's activation digits (1: the served 8-bit activations)")
    args = parser.parse_args()
    layout = INT_LAYOUT if args.layout == "int" else FLOAT_LAYOUT
    with tempfile.TemporaryDirectory() as tmp:
        ops = {name: build(gguf_gemm._LIBRARY, "gguf_gemm", name[0], source_text(SOURCE, rev), Path(tmp))
               for name, rev in (("a_before", args.before), ("b_after", args.after))}
        model = load_llama_gguf(prepare(), layout=layout)
        linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
        back_with_huge_pages()  # the packed weights on 2 MiB pages, as the engine keeps them
        print(f"{len(linears)} matrices, {args.layout} layout; before {args.before}, after {args.after}; "
              f"{torch.get_num_threads()} threads", flush=True)
        for t in args.tokens:
            x = {n: torch.randn(t, n) for n in {m.in_features for m in linears}}
            fns = {name: (lambda op=op, x=x: [op.gguf_mm(x[m.in_features], m.packed, m.out_features, m.qtype, m.layout,
                                                          args.digits)
                                              for m in linears]) for name, op in ops.items()}
            outs = [fn() for fn in fns.values()]
            if not all(torch.equal(a, b) for a, b in zip(*outs)):
                print(f"rows {t}: the two versions' outputs differ", flush=True)
                return 1
            best, times = dict.fromkeys(fns, float("inf")), {n: [] for n in fns}
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
                    best[name] = min(best[name], times[name][-1])
            a, b = best.values()
            ma, mb = (sorted(v)[len(v) // 2] for v in times.values())
            print(f"rows {t:4d}: before {a * 1e3:8.2f} ms   after {b * 1e3:8.2f} ms   {a / b:5.2f}x   "
                  f"(medians {ma * 1e3:8.2f} / {mb * 1e3:8.2f} ms, {ma / mb:5.2f}x)   same bits", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
