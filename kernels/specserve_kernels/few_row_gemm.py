"""A float32 matmul for a few rows on an AVX2 CPU: `x @ weight.T` that reads the weight at memory speed.

A decode or tree-verification step of a small model multiplies 1-16 rows by every weight matrix. At
one row a CPU step is bound by streaming the weights from memory; MKL's small-M kernels stay far
from that bound as rows are added. `few_row_mm` streams each 16-column panel of a prepacked weight
once and multiplies it by up to 6 rows in registers; more rows take further passes over the panel
from L2 while the next panel is prefetched (`cpu/few_row_gemm.cpp`). A weight whose values are all
bf16 numbers (a bf16 checkpoint served in float32) is stored in bf16 and widened in registers: the
same float32 products, bit for bit, from half the bytes. Each output element is one sequential sum
over k: a row's result is the same bit for bit whatever other rows it is multiplied with.

On a 2-core AVX2 EPYC (`bench/cpu_linear.py --kernel`, SmolLM2-135M's 121 matrices): float32
storage takes about as long at 6 rows as at 1 (memory-bound) and 1.7x that at 16 rows; bf16
storage halves the 1-2 row time. Inside the step program (`bench/cpu_step.py`, docs/performance.md)
12 tokens verify in 1.4x a decode's time with float32 storage, against 2.7x with inductor's
autotuned matmuls.

The kernel is a torch custom op (`torch.ops.specserve.few_row_mm`) with a shape function, so
`torch.export` and AOTInductor compile it into a program like any aten op; it is built once per
source with torch's C++ extension builder (g++, ninja) into the compile cache directory.
`FewRowLinear` is an `nn.Linear` through it; `few_row_linears` swaps them in for an export.

This module does nothing on CUDA, for other activation dtypes than float32, or on CPUs without
AVX2 and FMA (`supported`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from specserve_kernels import cpp_build

PANEL = 16  # output columns per packed panel (two AVX2 registers)
SOURCE = Path(__file__).with_name("cpu") / "few_row_gemm.cpp"
REQUIRED_FLAGS = frozenset({"avx2", "fma"})


def _register_fake() -> None:
    @torch.library.register_fake("specserve::few_row_mm")
    def _(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)


_LIBRARY = cpp_build.OpLibrary("specserve_few_row_gemm", SOURCE, REQUIRED_FLAGS, ["-mavx2", "-mfma"],
                               "the default matmuls", _register_fake)


def supported() -> bool:
    """Whether this machine can build and run the kernel: x86-64 with AVX2 and FMA, g++ and ninja."""
    return _LIBRARY.supported()


def source_digest() -> str:
    """What a compiled program that calls the op depends on: the kernel's source."""
    return _LIBRARY.source_digest()


def load(build_root: Path | None = None) -> bool:
    """Builds the op (once per source and torch version under `build_root`; later calls and
    processes load the built library) and registers it; True when `torch.ops.specserve.few_row_mm`
    is usable. False, with a warning, where it is not `supported` or the build fails: callers then
    keep their other matmuls. Only the first call of a process builds or loads anything."""
    return _LIBRARY.load(build_root)


def loaded() -> bool:
    """Whether an earlier `load` registered the op in this process (this never builds anything)."""
    return _LIBRARY.loaded()


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of a float32 weight is a bf16 number (a bf16 checkpoint served in
    float32): then its bf16 storage gives the same products from half the bytes."""
    return weight.dtype == torch.float32 and torch.equal(weight.to(torch.bfloat16).float(), weight)


def pack(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight (n, K) -> packed (ceil(n / 16), K, 16) of `dtype` (float32, or bf16: only where
    `bf16_exact`, else the products change): 16-column panels, zero-padded. A bf16 panel row is
    ordered c0, c8, c1, c9, ..., c7, c15 (the kernel widens each 32-bit lane into columns i and i + 8)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"few_row_gemm.pack: float32 or bfloat16 storage, got {dtype}")
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=dtype, device=weight.device)
    padded[:n] = weight.detach()
    packed = padded.view(panels, PANEL, k).transpose(1, 2)  # (NB, K, 16)
    if dtype == torch.bfloat16:
        packed = packed.reshape(panels, k, 2, PANEL // 2).transpose(2, 3)  # (NB, K, 8, 2): (c_i, c_i+8) pairs
    return packed.contiguous().view(panels, k, PANEL)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 weight (n, K) a packed one holds."""
    panels, k, _ = packed.shape
    if packed.dtype == torch.bfloat16:
        packed = packed.view(panels, k, PANEL // 2, 2).transpose(2, 3)
    return packed.float().reshape(panels, k, PANEL).transpose(1, 2).reshape(-1, k)[:n]


def few_row_mm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x (M, K) @ weight.T -> (M, n), weight as `pack` left it."""
    return torch.ops.specserve.few_row_mm(x, packed, n)


def few_row_mm_reference(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """The same product in plain torch (rounding may differ): the op's test oracle."""
    return x @ unpack(packed, n).T


class FewRowLinear(nn.Module):
    """An inference-only `nn.Linear` through `few_row_mm`: x (..., in) -> (..., out), float32. The
    weight is stored in bf16 where that is exact (`bf16_exact`), else in float32. Needs `load()` first."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """weight (out, in), bias (out,): an `nn.Linear`'s."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().float()
        storage = torch.bfloat16 if bf16_exact(weight) else torch.float32
        self.register_buffer("packed", pack(weight, storage), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = few_row_mm(x.reshape(-1, self.in_features), self.packed, self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"packed in {PANEL}-column {self.packed.dtype} panels")


@contextmanager
def few_row_linears(module: nn.Module) -> Iterator[int]:
    """Within the block, every float32 `nn.Linear` under `module` is a `FewRowLinear` (yields how
    many); the originals are put back on exit. For exporting a program of few-row forwards."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32:
                swapped.append((parent, name, child))
                setattr(parent, name, FewRowLinear(child.weight, child.bias))
    try:
        yield len(swapped)
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)


__all__ = ["FewRowLinear", "bf16_exact", "few_row_linears", "few_row_mm", "few_row_mm_reference", "load", "loaded",
           "pack", "supported", "unpack"]
