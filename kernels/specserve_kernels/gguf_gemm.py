"""A float32 matmul on a CPU from a GGUF file's own quantized blocks: `x @ weight.T` for Q4_0, Q4_1, Q8_0.

A decode step of a small model on a CPU is bound by reading its weights. SmolLM2-135M's GGUF holds
its linear layers in Q4_1 (20 bytes per 32 weights) and its tied embedding in Q8_0 (34 bytes): a
third of the bytes of a bf16 copy. `gguf_mm` reads those blocks, repacked once at load into
16-column panels (`pack`), widens the codes to float32 in registers, dequantizes them exactly as
GGUF defines (Q4_1 `d * q + m`, Q4_0 `d * (q - 8)`, Q8_0 `d * q`; `dequantize` is the same in
plain torch) and accumulates in float32 (`cpu/gguf_gemm.cpp`). Each output element is one
sequential sum over k, so a row's result is the same bit for bit whatever other rows it is
multiplied with: tree verification of a few tokens computes each as a decode would.

The kernel is a torch custom op (`torch.ops.specserve.gguf_mm`) with a shape function, so
`torch.export` and AOTInductor compile it into a program like any aten op; it is built once per
source with torch's C++ extension builder. `GGUFLinear` is an inference-only linear layer through it.

This module does nothing on CUDA, for activations other than float32, for GGUF types other than
Q4_0 / Q4_1 / Q8_0, or on CPUs without AVX2, FMA and F16C (`supported`). It does not read GGUF
files: callers hand it a tensor's raw blocks (`gguf.GGUFReader` gives them).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from specserve_kernels import cpp_build

log = logging.getLogger(__name__)

PANEL = 16  # output columns per packed panel
BLOCK = 32  # weights per GGUF block
SOURCE = Path(__file__).with_name("cpu") / "gguf_gemm.cpp"
REQUIRED_FLAGS = frozenset({"avx2", "fma", "f16c"})

# ggml's type numbers, and each type's bytes per block in the file and per (panel, block) record packed
Q4_0, Q4_1, Q8_0 = 2, 3, 8
QTYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0}
FILE_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
RECORD_BYTES = {Q4_0: 64 + 256, Q4_1: 64 + 256, Q8_0: 32 + 512}


def supported() -> bool:
    """Whether this machine can build and run the kernel: x86-64 with AVX2, FMA and F16C, g++ and ninja."""
    return cpp_build.can_build_for(REQUIRED_FLAGS)


def source_digest() -> str:
    """What a compiled program that calls the op depends on: the kernel's source."""
    return cpp_build.source_digest(SOURCE)


_loaded: bool | None = None


def load(build_root: Path | None = None) -> bool:
    """Builds the op (once per source and torch version under `build_root`) and registers it; True
    when `torch.ops.specserve.gguf_mm` is usable. False, with a warning, where it is not `supported`
    or the build fails. Only the first call of a process builds or loads anything."""
    global _loaded
    if _loaded is None:
        _loaded = supported() and _build(build_root)
    return _loaded


def _build(build_root: Path | None) -> bool:
    try:
        cpp_build.build("specserve_gguf_gemm", SOURCE, build_root or Path.home() / ".cache/specserve/kernels",
                        extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], extra_ldflags=["-fopenmp"],
                        is_python_module=False)
    except Exception as e:  # the C++ toolchain: the caller keeps its other weights
        log.warning("GGUF matmul kernel not built (%s: %s)", type(e).__name__, e)
        return False

    @torch.library.register_fake("specserve::gguf_mm")
    def _(x: torch.Tensor, packed: torch.Tensor, n: int, qtype: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)

    return True


def _check(raw: torch.Tensor, qtype: int) -> tuple[int, int]:
    if qtype not in FILE_BLOCK_BYTES:
        raise ValueError(f"gguf_gemm: GGUF type {qtype} is not one of Q4_0 (2), Q4_1 (3), Q8_0 (8)")
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % FILE_BLOCK_BYTES[qtype]:
        raise ValueError(f"gguf_gemm: raw blocks must be uint8 (n, blocks * {FILE_BLOCK_BYTES[qtype]}), "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    return raw.shape[0], raw.shape[1] // FILE_BLOCK_BYTES[qtype]


def _halves(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 little-endian -> (...) float16."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def codes_and_scales(raw: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tensor's raw GGUF blocks (n, blocks * bytes) -> codes (n, blocks, 32) (uint8 0-15 for Q4,
    int8 for Q8_0), d and m (n, blocks) float16, each weight being d * code + m (m 0 for Q8_0)."""
    n, blocks = _check(raw, qtype)
    b = raw.reshape(n, blocks, FILE_BLOCK_BYTES[qtype])
    d = _halves(b[..., 0:2])
    if qtype == Q8_0:
        return b[..., 2:].contiguous().view(torch.int8), d, torch.zeros_like(d)
    qs = b[..., 4:] if qtype == Q4_1 else b[..., 2:]  # element j in qs[j]'s low nibble, j + 16 in its high one
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1)
    m = _halves(b[..., 2:4]) if qtype == Q4_1 else -8 * d  # Q4_0: d * (q - 8), exact in float16
    return codes, d, m


def dequantize(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """The weight (n, blocks * 32) in float32, exactly as GGUF defines it (the kernel's reference)."""
    codes, d, m = codes_and_scales(raw, qtype)
    w = codes.float() * d.float()[..., None] + m.float()[..., None]  # d * code is exact in float32
    return w.reshape(codes.shape[0], -1)


def pack(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """A tensor's raw GGUF blocks (n, blocks * bytes), rows the output features -> packed
    (ceil(n / 16), blocks, record bytes) uint8, the layout `cpu/gguf_gemm.cpp` describes; padded
    columns are zero weights."""
    codes, d, m = codes_and_scales(raw, qtype)
    n, blocks, _ = codes.shape
    panels = -(-n // PANEL)
    pad = panels * PANEL - n

    def panelled(t: torch.Tensor) -> torch.Tensor:  # (n, blocks, ...) -> (panels, blocks, 16, ...)
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
        return t.reshape(panels, PANEL, blocks, *t.shape[2:]).transpose(1, 2)

    def scale_bytes(s: torch.Tensor) -> torch.Tensor:
        return panelled(s).contiguous().view(torch.uint8).reshape(panels, blocks, 2 * PANEL)

    if qtype == Q8_0:
        q = panelled(codes.view(torch.uint8)).transpose(2, 3)  # (panels, blocks, 32 k, 16 columns)
        return torch.cat([scale_bytes(d), q.reshape(panels, blocks, -1)], dim=-1).contiguous()
    q = panelled(codes).transpose(2, 3).reshape(panels, blocks, BLOCK // 2, 2, PANEL)  # k steps in pairs
    pairs = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # (panels, blocks, 16 pairs, 16 columns)
    return torch.cat([scale_bytes(d), scale_bytes(m), pairs.reshape(panels, blocks, -1)], dim=-1).contiguous()


def unpack(packed: torch.Tensor, n: int, qtype: int) -> torch.Tensor:
    """The float32 weight (n, K) a packed one holds (exact, as `dequantize`)."""
    panels, blocks, _ = packed.shape
    d = packed[..., :32].contiguous().view(torch.float16).float()  # (panels, blocks, 16)
    if qtype == Q8_0:
        m = torch.zeros_like(d)
        codes = packed[..., 32:].contiguous().view(torch.int8).reshape(panels, blocks, BLOCK, PANEL)
    else:
        m = packed[..., 32:64].contiguous().view(torch.float16).float()
        pairs = packed[..., 64:].reshape(panels, blocks, BLOCK // 2, PANEL)
        codes = torch.stack([pairs & 0xF, pairs >> 4], dim=3).reshape(panels, blocks, BLOCK, PANEL)
    w = codes.float() * d[:, :, None] + m[:, :, None]  # (panels, blocks, 32 k, 16 columns)
    return w.permute(0, 3, 1, 2).reshape(panels * PANEL, blocks * BLOCK)[:n]


def gguf_mm(x: torch.Tensor, packed: torch.Tensor, n: int, qtype: int) -> torch.Tensor:
    """x (M, K) float32 @ weight.T -> (M, n), weight as `pack` left it."""
    return torch.ops.specserve.gguf_mm(x, packed, n, qtype)


class GGUFLinear(nn.Module):
    """An inference-only linear layer (no bias) on a GGUF tensor's blocks: x (..., in) float32 ->
    (..., out) float32. Needs `load()` first. `rows` selects output features (a fused projection
    concatenates several tensors' rows: `GGUFLinear.concat`)."""

    def __init__(self, raw: torch.Tensor, qtype: int) -> None:
        """raw (out, in / 32 * block bytes) uint8: a GGUF tensor's blocks, one row per output feature."""
        super().__init__()
        n, blocks = _check(raw, qtype)
        self.out_features, self.in_features, self.qtype = n, blocks * BLOCK, qtype
        # persistent: a compiled program's key digests the state dict, so these bytes name the program
        self.register_buffer("packed", pack(raw, qtype))
        self.weight_nbytes = self.packed.nbytes  # what one forward reads
        self._weight: torch.Tensor | None = None

    @classmethod
    def concat(cls, raws: list[torch.Tensor], qtype: int) -> GGUFLinear:
        """One layer whose outputs are the given tensors' outputs, in order (fused q/k/v, gate/up)."""
        return cls(torch.cat(raws), qtype)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight (out, in) this layer multiplies by."""
        return unpack(self.packed, self.out_features, self.qtype)

    @property
    def weight(self) -> torch.Tensor:
        """`dequantized()`, built on first read and kept (for readers of a shared lm_head's matrix:
        it costs 4 bytes a weight, which the matmul never reads)."""
        if self._weight is None:
            self._weight = self.dequantized()
        return self._weight

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Output features `ids` (N,) of the weight, float32 (N, in), exact: an embedding lookup on a
        tied lm_head's blocks."""
        records, column = self.packed[ids // PANEL], ids % PANEL  # (N, blocks, bytes)
        n, blocks, _ = records.shape
        pick = torch.arange(n, device=ids.device)
        d = records[..., :32].contiguous().view(torch.float16).float()[pick, :, column]  # (N, blocks)
        if self.qtype == Q8_0:
            codes = records[..., 32:].contiguous().view(torch.int8).reshape(n, blocks, BLOCK, PANEL)[pick, ..., column]
            return (codes.float() * d[..., None]).reshape(n, -1)
        m = records[..., 32:64].contiguous().view(torch.float16).float()[pick, :, column]
        pairs = records[..., 64:].reshape(n, blocks, BLOCK // 2, PANEL)[pick, ..., column]  # (N, blocks, 16)
        codes = torch.stack([pairs & 0xF, pairs >> 4], dim=-1).reshape(n, blocks, BLOCK)
        return (codes.float() * d[..., None] + m[..., None]).reshape(n, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = gguf_mm(x.reshape(-1, self.in_features), self.packed, self.out_features, self.qtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        name = next(k for k, v in QTYPES.items() if v == self.qtype)
        return f"in_features={self.in_features}, out_features={self.out_features}, {name} in {PANEL}-column panels"


__all__ = ["GGUFLinear", "QTYPES", "Q4_0", "Q4_1", "Q8_0", "codes_and_scales", "dequantize", "gguf_mm", "load",
           "pack", "supported", "unpack"]
