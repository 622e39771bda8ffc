"""A float32 matmul on a CPU from a GGUF file's own quantized blocks: `x @ weight.T` for Q4_0, Q4_1, Q8_0.

A decode step of a small model on a CPU is bound by reading its weights. SmolLM2-135M's GGUF holds
its linear layers in Q4_1 (20 bytes per 32 weights) and its tied embedding in Q8_0 (34 bytes): a
third of the bytes of a bf16 copy. `gguf_mm` reads those blocks, repacked once at load into
16-column panels (`pack`), in one of two layouts (`cpu/gguf_gemm.cpp` describes both):

- `FLOAT_LAYOUT`: the kernel widens the codes to float32 in registers, dequantizes them exactly as
  GGUF defines (Q4_1 `d * q + m`, Q4_0 `d * (q - 8)`, Q8_0 `d * q`; `dequantize` is the same in
  plain torch) and accumulates in float32. Runs on AVX2 + FMA + F16C.
- `INT_LAYOUT`: the kernel splits each row's activations, per block of 32, into three int8 digits
  of a scale s = max|x| / 127 (x = s (a0 + a1 / 254 + a2 / 254^2) within about 6e-8 of the block's
  largest |x|), multiplies the codes by each digit exactly in int32 (AVX-512 VNNI's vpdpbusd, or
  AVX2's vpmaddubsw for the 4-bit types) and combines the three sums per block in float32. Fewer
  instructions per weight: near the speed of reading the weights at one row. Its numbers are those
  of float32 arithmetic on activations rounded to about 24 bits relative to their block's largest
  element (an element 2^24 times smaller than its block's largest is lost, as in a float32 sum of
  the two). Q8_0 needs VNNI (`int_layout_runs`). `digits` keeps fewer of them: 1 is llama.cpp's
  int8 rounding of the activations (about 2^-8 of the block's largest), 2 about 2^-16; a row then
  costs the kernel about a third (a half) of the integer work, which is what verifying a tree's
  tokens and prefilling a prompt pay for (`ACTIVATION_DIGITS` names them for the engine's
  `gguf_activations`).

Each output element goes through the same operations whatever the other rows, so a row's result is
the same bit for bit whatever other rows it is multiplied with: tree verification of a few tokens
computes each as a decode would. `GGUFLinear` packs in the integer layout where this CPU runs it
with AVX-512 VNNI, and in the float layout otherwise (or as asked): `default_layout`.

The kernel is a torch custom op (`torch.ops.specserve.gguf_mm`) with a shape function, so
`torch.export` and AOTInductor compile it into a program like any aten op; it is built once per
source with torch's C++ extension builder. `GGUFLinear` is an inference-only linear layer through it.
`SPECSERVE_GGUF_ISA=avx2` (or `avx512-256`) in the environment restricts the integer kernel to
AVX2 (or 256-bit AVX-512 vectors), to compare them on one machine.

This module does nothing on CUDA, for activations other than float32, for GGUF types other than
Q4_0 / Q4_1 / Q8_0, or on CPUs without AVX2, FMA and F16C (`supported`). It does not read GGUF
files: callers hand it a tensor's raw blocks (`gguf.GGUFReader` gives them).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from specserve_kernels import cpp_build

PANEL = 16  # output columns per packed panel
BLOCK = 32  # weights per GGUF block
SOURCE = Path(__file__).with_name("cpu") / "gguf_gemm.cpp"
REQUIRED_FLAGS = frozenset({"avx2", "fma", "f16c"})

VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})

# ggml's type numbers, and each type's bytes per block in the file and per (panel, block) record packed
Q4_0, Q4_1, Q8_0 = 2, 3, 8
QTYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0}
FILE_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
FLOAT_LAYOUT, INT_LAYOUT = 0, 1  # the op's `layout` argument
LAYOUTS = {"float": FLOAT_LAYOUT, "int": INT_LAYOUT}
RECORD_BYTES = {Q4_0: 64 + 256, Q4_1: 64 + 256, Q8_0: 32 + 512}  # the float layout's
INT_RECORD_BYTES = {Q4_0: 32 + 256, Q4_1: 64 + 256, Q8_0: 32 + 512}  # the integer layout's
EXACT_DIGITS = 3  # the integer layout's activation digits that keep float32's precision
# the engine's `gguf_activations` (auto: q8, kept where the compiled programs run)
ACTIVATION_DIGITS = {"auto": 1, "q8": 1, "q16": 2, "float32": EXACT_DIGITS}


def record_bytes(qtype: int, layout: int) -> int:
    """Bytes of one (panel, block) record of `qtype` packed in `layout`."""
    return (INT_RECORD_BYTES if layout == INT_LAYOUT else RECORD_BYTES)[qtype]


def int_kernel() -> str:
    """The integer layout's kernel on this CPU: "avx512" (512-bit vectors), "avx512-256", "avx2" or "none"
    (`SPECSERVE_GGUF_ISA` caps it); from /proc/cpuinfo, before anything is built."""
    flags = cpp_build.cpu_flags()
    if not REQUIRED_FLAGS <= flags:
        return "none"
    best = "avx512" if VNNI_FLAGS <= flags else "avx2"
    cap = os.environ.get("SPECSERVE_GGUF_ISA", "")
    if cap == "avx2" or (cap == "avx512-256" and best == "avx2"):
        return "avx2"
    return "avx512-256" if cap == "avx512-256" else best


def int_layout_runs(qtype: int) -> bool:
    """Whether this CPU's integer kernel serves `qtype` (Q4_0 / Q4_1: AVX2; Q8_0: AVX-512 VNNI)."""
    kernel = int_kernel()
    return kernel.startswith("avx512") or (kernel == "avx2" and qtype != Q8_0)


def default_layout(qtype: int) -> int:
    """The layout `GGUFLinear` packs `qtype` in: the integer one where this CPU runs it with 512-bit
    VNNI, else the float one. Measured on one Zen 4 (`bench/cpu_linear.py --gguf`): the 512-bit
    integer kernel is 1.2x the float one at 1 row and 1.7-2x at 4-16; its AVX2 form (vpmaddubsw)
    is 1.07x at 1 row but 0.65-0.81x at 2-12 rows, and the 256-bit VNNI one about the float one's
    speed from 4 rows."""
    return INT_LAYOUT if int_kernel() == "avx512" and int_layout_runs(qtype) else FLOAT_LAYOUT


def _register_fake() -> None:
    @torch.library.register_fake("specserve::gguf_mm")
    def _(x: torch.Tensor, packed: torch.Tensor, n: int, qtype: int, layout: int, digits: int = 3) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)


_LIBRARY = cpp_build.OpLibrary("specserve_gguf_gemm", SOURCE, REQUIRED_FLAGS, ["-mavx2", "-mfma", "-mf16c"],
                               "the other weights", _register_fake)


def supported() -> bool:
    """Whether this machine can build and run the kernel: x86-64 with AVX2, FMA and F16C, g++ and ninja."""
    return _LIBRARY.supported()


def source_digest() -> str:
    """What a compiled program that calls the op depends on: the kernel's source."""
    return _LIBRARY.source_digest()


def load(build_root: Path | None = None) -> bool:
    """Builds the op (once per source and torch version under `build_root`) and registers it; True
    when `torch.ops.specserve.gguf_mm` is usable. False, with a warning, where it is not `supported`
    or the build fails. Only the first call of a process builds or loads anything."""
    return _LIBRARY.load(build_root)


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


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """A float weight (n, K), K whole blocks of 32 -> its raw Q8_0 blocks (n, K / 32 * 34) uint8, as ggml's
    reference quantizer makes them: per block d = max |w| / 127 (stored as float16) and codes
    round(w / d), halves away from zero. Lossy (about 2^-8 of a block's largest weight): for weights
    that may change a little, a draft head's, never the target's."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"gguf_gemm.quantize_q8_0: {k} inputs are not whole blocks of {BLOCK}")
    b = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = b.abs().amax(dim=-1) / 127
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))[..., None]
    scaled = b * inverse
    codes = (scaled.sign() * torch.floor(scaled.abs() + 0.5)).to(torch.int8)  # C's roundf
    scale = d.to(torch.float16)[..., None].view(torch.uint8)  # (n, blocks, 2), little-endian
    return torch.cat([scale, codes.view(torch.uint8)], dim=-1).reshape(n, -1)


def pack(raw: torch.Tensor, qtype: int, layout: int = FLOAT_LAYOUT) -> torch.Tensor:
    """A tensor's raw GGUF blocks (n, blocks * bytes), rows the output features -> packed
    (ceil(n / 16), blocks, `record_bytes`) uint8, in the layout `cpu/gguf_gemm.cpp` describes; padded
    columns are zero weights."""
    if layout not in LAYOUTS.values():
        raise ValueError(f"gguf_gemm: layout {layout} is not FLOAT_LAYOUT (0) or INT_LAYOUT (1)")
    codes, d, m = codes_and_scales(raw, qtype)
    n, blocks, _ = codes.shape
    panels = -(-n // PANEL)
    pad = panels * PANEL - n

    def panelled(t: torch.Tensor) -> torch.Tensor:  # (n, blocks, ...) -> (panels, blocks, 16, ...)
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
        return t.reshape(panels, PANEL, blocks, *t.shape[2:]).transpose(1, 2)

    def scale_bytes(s: torch.Tensor) -> torch.Tensor:
        return panelled(s).contiguous().view(torch.uint8).reshape(panels, blocks, 2 * PANEL)

    if layout == INT_LAYOUT:
        q = panelled(codes.view(torch.uint8))  # (panels, blocks, 16 columns, 32 k)
        if qtype == Q8_0:  # code + 128; chunk j, byte 4 c + i: column c at k = 4 j + i
            q = (q ^ 0x80).reshape(panels, blocks, PANEL, BLOCK // 4, 4).transpose(2, 3)
            return torch.cat([scale_bytes(d), q.reshape(panels, blocks, -1)], dim=-1).contiguous()
        # chunk j, byte 4 c + i: column c at k = 8 j + i (low nibble) and at k = 8 j + 4 + i (high nibble)
        q = q.reshape(panels, blocks, PANEL, BLOCK // 8, 2, 4).permute(0, 1, 3, 2, 5, 4)
        nibbles = (q[..., 0] | (q[..., 1] << 4)).reshape(panels, blocks, -1)
        head = [scale_bytes(d), scale_bytes(m)] if qtype == Q4_1 else [scale_bytes(d)]
        return torch.cat([*head, nibbles], dim=-1).contiguous()
    if qtype == Q8_0:
        q = panelled(codes.view(torch.uint8)).transpose(2, 3)  # (panels, blocks, 32 k, 16 columns)
        return torch.cat([scale_bytes(d), q.reshape(panels, blocks, -1)], dim=-1).contiguous()
    q = panelled(codes).transpose(2, 3).reshape(panels, blocks, BLOCK // 2, 2, PANEL)  # k steps in pairs
    pairs = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # (panels, blocks, 16 pairs, 16 columns)
    return torch.cat([scale_bytes(d), scale_bytes(m), pairs.reshape(panels, blocks, -1)], dim=-1).contiguous()


def _decode(records: torch.Tensor, qtype: int, layout: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed records (N, blocks, bytes) -> d and m (N, blocks, 16) float32, codes (N, blocks, 16 columns, 32 k)
    (uint8 0-15 for Q4, int8 for Q8_0), each weight d * code + m."""
    if records.shape[-1] != record_bytes(qtype, layout):
        raise ValueError(f"gguf_gemm: records of {records.shape[-1]} bytes are not qtype {qtype} in layout {layout}")
    n, blocks, _ = records.shape
    d = records[..., :32].contiguous().view(torch.float16).float()
    if layout == INT_LAYOUT:
        if qtype == Q8_0:
            q = (records[..., 32:] ^ 0x80).view(torch.int8).reshape(n, blocks, BLOCK // 4, PANEL, 4)
            return d, torch.zeros_like(d), q.transpose(2, 3).reshape(n, blocks, PANEL, BLOCK)
        start = 64 if qtype == Q4_1 else 32
        m = records[..., 32:64].contiguous().view(torch.float16).float() if qtype == Q4_1 else -8 * d
        b = records[..., start:].reshape(n, blocks, BLOCK // 8, PANEL, 4)  # (chunk j, column c, i)
        q = torch.stack([b & 0xF, b >> 4], dim=-1)  # (j, c, i, h): k = 8 j + 4 h + i
        return d, m, q.permute(0, 1, 3, 2, 5, 4).reshape(n, blocks, PANEL, BLOCK)
    if qtype == Q8_0:
        q = records[..., 32:].contiguous().view(torch.int8).reshape(n, blocks, BLOCK, PANEL)
        return d, torch.zeros_like(d), q.transpose(2, 3)
    m = records[..., 32:64].contiguous().view(torch.float16).float()
    pairs = records[..., 64:].reshape(n, blocks, BLOCK // 2, PANEL)
    q = torch.stack([pairs & 0xF, pairs >> 4], dim=3).reshape(n, blocks, BLOCK, PANEL)
    return d, m, q.transpose(2, 3)


def unpack(packed: torch.Tensor, n: int, qtype: int, layout: int = FLOAT_LAYOUT) -> torch.Tensor:
    """The float32 weight (n, K) a packed one holds (exact, as `dequantize`)."""
    panels, blocks, _ = packed.shape
    d, m, codes = _decode(packed, qtype, layout)
    w = codes.float() * d[..., None] + m[..., None]  # (panels, blocks, 16 columns, 32 k)
    return w.transpose(1, 2).reshape(panels * PANEL, blocks * BLOCK)[:n]


def gguf_mm(x: torch.Tensor, packed: torch.Tensor, n: int, qtype: int, layout: int = FLOAT_LAYOUT,
            digits: int = EXACT_DIGITS) -> torch.Tensor:
    """x (M, K) float32 @ weight.T -> (M, n), weight as `pack` left it in `layout`; `digits`: the int8
    digits the integer layout keeps of each activation (the float layout ignores it)."""
    return torch.ops.specserve.gguf_mm(x, packed, n, qtype, layout, digits)


def activation_digits(model: nn.Module) -> tuple[int, ...]:
    """The activation digits of `model`'s GGUF layers in the integer layout, each once (empty without
    any): what a compiled program of it bakes in besides its state dict."""
    return tuple(sorted({m.digits for m in model.modules() if isinstance(m, GGUFLinear) and m.layout == INT_LAYOUT}))


def set_activation_digits(model: nn.Module, digits: int) -> None:
    """Every GGUF layer of `model` keeps `digits` activation digits from its next call on."""
    for m in model.modules():
        if isinstance(m, GGUFLinear):
            m.digits = digits


class GGUFLinear(nn.Module):
    """An inference-only linear layer (no bias) on a GGUF tensor's blocks: x (..., in) float32 ->
    (..., out) float32. Needs `load()` first. `rows` selects output features (a fused projection
    concatenates several tensors' rows: `GGUFLinear.concat`)."""

    def __init__(self, raw: torch.Tensor, qtype: int, layout: int | None = None, digits: int = EXACT_DIGITS) -> None:
        """raw (out, in / 32 * block bytes) uint8: a GGUF tensor's blocks, one row per output feature.
        layout: FLOAT_LAYOUT or INT_LAYOUT; default `default_layout(qtype)`."""
        super().__init__()
        n, blocks = _check(raw, qtype)
        self.out_features, self.in_features, self.qtype = n, blocks * BLOCK, qtype
        self.layout = default_layout(qtype) if layout is None else layout
        self.digits = digits
        # persistent: a compiled program's key digests the state dict, so these bytes name the program
        self.register_buffer("packed", pack(raw, qtype, self.layout))
        self.weight_nbytes = self.packed.nbytes  # what one forward reads
        self._weight: torch.Tensor | None = None

    @classmethod
    def concat(cls, raws: list[torch.Tensor], qtype: int, layout: int | None = None,
               digits: int = EXACT_DIGITS) -> GGUFLinear:
        """One layer whose outputs are the given tensors' outputs, in order (fused q/k/v, gate/up)."""
        return cls(torch.cat(raws), qtype, layout, digits)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight (out, in) this layer multiplies by."""
        return unpack(self.packed, self.out_features, self.qtype, self.layout)

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
        d, m, codes = _decode(self.packed[ids // PANEL], self.qtype, self.layout)  # (N, blocks, 16[, 32])
        pick, column = torch.arange(ids.shape[0], device=ids.device), ids % PANEL
        d, m, codes = d[pick, :, column], m[pick, :, column], codes[pick, :, column]  # (N, blocks[, 32])
        return (codes.float() * d[..., None] + m[..., None]).reshape(ids.shape[0], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = gguf_mm(x.reshape(-1, self.in_features), self.packed, self.out_features, self.qtype, self.layout,
                      self.digits)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        name = next(k for k, v in QTYPES.items() if v == self.qtype)
        layout = next(k for k, v in LAYOUTS.items() if v == self.layout)
        return (f"in_features={self.in_features}, out_features={self.out_features}, {name} in {PANEL}-column panels, "
                f"{layout} layout")


__all__ = ["ACTIVATION_DIGITS", "EXACT_DIGITS", "FLOAT_LAYOUT", "INT_LAYOUT", "GGUFLinear", "QTYPES", "Q4_0", "Q4_1",
           "Q8_0", "activation_digits", "codes_and_scales", "default_layout", "dequantize", "gguf_mm", "int_kernel",
           "int_layout_runs", "load", "pack", "quantize_q8_0", "record_bytes", "set_activation_digits", "supported",
           "unpack"]
