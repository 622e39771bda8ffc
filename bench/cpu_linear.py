"""Micro-benchmark behind the engine's CPU linears (bf16, this machine's threads): `F.linear` on
plain bf16 weights vs weights prepacked for oneDNN (`specserve.models.cpu_linear.PackedLinear`), over
the 121 weight matrices of SmolLM2-135M (or any --hidden/--intermediate/--layers/--vocab), each
read once per pass so caches stay cold, as in a decode step. Reported as GB/s of weights read,
next to a read-only reduction's bandwidth.

`--few-rows`: a draft head's float32 logits instead (a --draft-vocab x --hidden weight):
`F.linear` against `few_row_linear`, the same product ordered weight @ x^T, and against
`Int8Linear`, its int8-weight approximation.

`--kernel`: the same 121 matrices in float32 through the AVX2 few-row kernel
(`specserve_kernels.few_row_gemm`), as the target's step program runs them, in ms, GB/s of weights
and GFLOP/s; `--storage bfloat16` stores them in bf16 (float32 arithmetic), as the program does for
a bf16 checkpoint. `--library` loads a kernel library built from another source instead of building this
checkout's (to compare two versions, run each in its own process, alternately).

`--gguf`: SmolLM2's own GGUF blocks through the GGUF kernel (`gguf_gemm`) in both packed layouts (float
and integer, timed alternately in one process), against the floor of their bytes and beside the same
weights dequantized, in float32 (sgemm) and in bf16 prepacked. `SPECSERVE_GGUF_ISA=avx2` or `avx512-256`
in the environment narrows the integer kernel.

    .venv/bin/python bench/cpu_linear.py [--tokens 1 4 16]
    .venv/bin/python bench/cpu_linear.py --few-rows [--tokens 1 4 8 32]
    .venv/bin/python bench/cpu_linear.py --kernel [--storage bfloat16] [--tokens 1 2 4 6 8 12 16] [--library PATH.so]
    .venv/bin/python bench/cpu_linear.py --gguf [--tokens 1 2 4 8 12 16] [--repeats 15]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from specserve.bench import read_bandwidth_gbs
from specserve.models.cpu_linear import Int8Linear, PackedLinear, can_pack, few_row_linear


def best_seconds(fn, repeats: int = 5) -> float:  # noqa: ANN001
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def target_shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(out, in) of every weight matrix a target step reads: fused qkv, o, fused gate/up, down; lm_head."""
    h, i = args.hidden, args.intermediate
    qkv = h + 2 * (h // 3)  # SmolLM2: 9 query heads, 3 K/V heads
    return [(qkv, h), (h, h), (2 * i, h), (h, i)] * args.layers + [(args.vocab, h)]


def linears(args: argparse.Namespace) -> None:
    h, i = args.hidden, args.intermediate
    weights = [torch.randn(s, dtype=torch.bfloat16) * 0.02 for s in target_shapes(args)]
    nbytes = sum(w.nbytes for w in weights)
    packed = [PackedLinear(w) for w in weights]
    print(f"weights {nbytes / 1e6:.0f} MB; read bandwidth {read_bandwidth_gbs():.1f} GB/s")
    for t in args.tokens:
        x = {n: torch.randn(t, n, dtype=torch.bfloat16) for n in (h, i)}
        plain = best_seconds(lambda x=x: [F.linear(x[w.shape[1]], w) for w in weights])
        pack = best_seconds(lambda x=x: [p(x[p.in_features]) for p in packed])
        print(f"tokens {t:2d}: F.linear {plain * 1e3:6.2f} ms ({nbytes / plain / 1e9:4.1f} GB/s)   "
              f"packed {pack * 1e3:6.2f} ms ({nbytes / pack / 1e9:4.1f} GB/s)   {plain / pack:.2f}x")


@torch.inference_mode()
def few_rows(args: argparse.Namespace) -> None:
    weight = torch.randn(args.draft_vocab, args.hidden) * 0.02
    int8 = Int8Linear(weight)
    print(f"float32 logits over {args.draft_vocab} x {args.hidden} ({weight.nbytes / 1e6:.0f} MB)")
    for t in args.tokens:
        x = torch.randn(t, args.hidden)
        plain = best_seconds(lambda x=x: F.linear(x, weight), repeats=20)
        fast = best_seconds(lambda x=x: few_row_linear(x, weight), repeats=20)
        approx = best_seconds(lambda x=x: int8(x), repeats=20)
        print(f"rows {t:2d}: F.linear {plain * 1e3:6.2f} ms   few_row_linear {fast * 1e3:6.2f} ms   "
              f"{plain / fast:.2f}x   Int8Linear {approx * 1e3:6.2f} ms   {plain / approx:.2f}x")


@torch.inference_mode()
def kernel(args: argparse.Namespace) -> None:
    from specserve_kernels import few_row_gemm

    if args.library:
        torch.ops.load_library(args.library)
    elif not few_row_gemm.load():
        raise SystemExit("the few-row kernel is not supported or did not build on this machine")
    storage = getattr(torch, args.storage)
    weights = [(few_row_gemm.pack(torch.randn(s) * 0.02, storage), s[0]) for s in target_shapes(args)]
    nbytes = sum(p.nbytes for p, _ in weights)
    params = sum(n * p.shape[1] for p, n in weights)
    print(f"kernel {args.library or few_row_gemm.source_digest()}: {len(weights)} matrices, "
          f"{nbytes / 1e6:.0f} MB of {args.storage} weights")
    for t in args.tokens:
        x = {n: torch.randn(t, n) for n in (args.hidden, args.intermediate)}
        seconds = best_seconds(lambda x=x: [few_row_gemm.few_row_mm(x[p.shape[1]], p, n) for p, n in weights],
                               repeats=7)
        print(f"rows {t:2d}: {seconds * 1e3:6.2f} ms   {nbytes / seconds / 1e9:5.1f} GB/s   "
              f"{2 * t * params / seconds / 1e9:6.1f} GFLOP/s")


def best_seconds_alternately(fns: list, repeats: int) -> list[float]:  # noqa: ANN001
    """Best time of each function, the functions run in turn in every repeat (a neighbour's load hits all alike)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


@torch.inference_mode()
def gguf(args: argparse.Namespace) -> None:
    """SmolLM2's own GGUF blocks (fused qkv and gate/up, the Q8_0 lm_head) through the GGUF kernel in the float
    and the integer layout, beside the same weights dequantized to float32 (`torch.mm`, MKL's sgemm: the same
    float32 arithmetic at 4 bytes a weight) and to bf16 prepacked for oneDNN (what the bf16 checkpoint's engine
    runs)."""
    from specserve.models.gguf import load_llama_gguf
    from specserve.prepare import prepare
    from specserve_kernels import gguf_gemm
    from specserve_kernels.gguf_gemm import FLOAT_LAYOUT, GGUFLinear

    model_dir = prepare()
    layouts = {"float": FLOAT_LAYOUT}
    if any(gguf_gemm.int_layout_runs(q) for q in gguf_gemm.QTYPES.values()):
        layouts["int"] = None  # each type in its default layout: the integer one where this CPU runs it
    models = {name: load_llama_gguf(model_dir, layout=layout) for name, layout in layouts.items()}
    blocks = {name: [m for m in model.modules() if isinstance(m, GGUFLinear)] for name, model in models.items()}
    float_blocks = blocks["float"]
    dense = [m.dequantized().contiguous() for m in float_blocks]  # (out, in) float32
    packed = [PackedLinear(w.bfloat16()) for w in dense] if can_pack(torch.device("cpu"), torch.bfloat16) else []
    read = read_bandwidth_gbs()
    floors = {name: sum(m.weight_nbytes for m in ms) / (read * 1e9) for name, ms in blocks.items()}
    print(f"{len(float_blocks)} matrices; read bandwidth {read:.1f} GB/s; integer kernel {gguf_gemm.int_kernel()}; "
          + ", ".join(f"{name} layout {sum(m.weight_nbytes for m in blocks[name]) / 1e6:.1f} MB, floor "
                      f"{floors[name] * 1e3:.2f} ms" for name in blocks))
    for t in args.tokens:
        x = {n: torch.randn(t, n) for n in (args.hidden, args.intermediate)}
        fns = [lambda ms=ms, x=x: [m(x[m.in_features]) for m in ms] for ms in blocks.values()]
        fns.append(lambda x=x: [torch.mm(x[w.shape[1]], w.T) for w in dense])
        if packed:
            xb = {n: v.bfloat16() for n, v in x.items()}
            fns.append(lambda xb=xb: [p(xb[p.in_features]) for p in packed])
        seconds = best_seconds_alternately(fns, args.repeats)
        line = f"rows {t:2d}:" + "".join(f"   {name} {s * 1e3:6.2f} ms ({floors[name] / s:4.0%} of the floor)"
                                         for name, s in zip(blocks, seconds))
        if "int" in blocks:
            line += f"   int {seconds[0] / seconds[1]:.2f}x as fast"
        line += f"   float32 sgemm {seconds[len(blocks)] * 1e3:6.2f} ms"
        if packed:
            line += f"   bf16 prepacked {seconds[-1] * 1e3:6.2f} ms"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--few-rows", action="store_true",
                        help="float32 draft logits: F.linear vs few_row_linear vs Int8Linear")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--kernel", action="store_true", help="float32 target matrices through the few-row kernel")
    parser.add_argument("--library", default="", help="with --kernel: a built kernel library to load instead")
    parser.add_argument("--storage", default="float32", choices=["float32", "bfloat16"],
                        help="with --kernel: how the weights are stored (the arithmetic is float32 either way)")
    parser.add_argument("--gguf", action="store_true",
                        help="SmolLM2's GGUF blocks through the GGUF kernel (both layouts), beside float32 sgemm "
                             "and bf16 prepacked")
    parser.add_argument("--repeats", type=int, default=15, help="with --gguf: timed repeats, best kept")
    args = parser.parse_args()
    if args.gguf:
        return gguf(args)
    if args.few_rows:
        return few_rows(args)
    if args.kernel:
        return kernel(args)
    if not can_pack(torch.device("cpu"), torch.bfloat16):
        raise SystemExit("this CPU's oneDNN has no bf16 linear: nothing to compare")
    linears(args)


if __name__ == "__main__":
    main()
