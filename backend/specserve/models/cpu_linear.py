"""bf16 linear layers on CPU with their weights prepacked once into oneDNN's blocked layout.

`F.linear` on a plain bf16 weight reads its weights more slowly at one token than the same weights
prepacked with `mkldnn._reorder_linear_weight` and multiplied by `mkldnn._linear_pointwise`
(`bench/cpu_linear.py` measures both; figures in `docs/performance.md`). The result equals
`F.linear`'s bit for bit at a few rows (decode, small trees); at some larger row counts oneDNN picks
another kernel and a product may differ by one bf16 rounding (measured on AMX at 33, 64, 128 rows).

This module packs inference-only weights: a packed linear has no autograd and is never saved.
It does nothing on CUDA, in fp32, or where oneDNN lacks bf16. In fp32 on a CPU, a draft head's
logits have three candidate output layers, and `fastest_logits_layer` times them on this CPU: the
few-row kernel (`FewRowLinear`: the same float32 products from panels streamed once, in bf16 where
the weights are bf16 numbers), `few_row_linear` (MKL in the faster order for a few rows), and
`Int8Linear`, an approximation (int8 weights) for those logits alone: a draft's logits only rank
its candidate tokens, and verification decides exactly whatever they are. For the same reason a
float32 draft head's linear layers may run on 8-bit GGUF blocks (`quantize_linears`, the
`draft_model_quantization` knob, SGLang's name): half the bytes of its bf16 weights, through the GGUF kernel.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve_kernels import few_row_gemm, gguf_gemm

FEW_ROWS = 64
EXACT_ROWS = 16  # row counts up to this run as they are (decode, small trees): few shapes


def padded_rows(n: int) -> int:
    """The row count a oneDNN call of n rows runs at: n up to EXACT_ROWS, else n rounded up to an
    eighth of the power of two above it (at most 12.5 % padding; 72 sizes up to 2,048).

    oneDNN builds kernels for every matmul and attention shape it meets and does not give all of
    that memory back: a server whose prompt chunks and catch-ups took every length grew by hundreds
    of MB a minute. A bounded set of shapes bounds it (docs/performance.md)."""
    if n <= EXACT_ROWS:
        return n
    step = 1 << ((n - 1).bit_length() - 4)
    return -(-n // step) * step


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear(nn.Module):
    """`F.linear(x, weight, bias)` for inference with the weight in oneDNN's layout (batch-size
    hint 1). `weight` stays readable only with `keep_weight` (e.g. an lm_head that drafters share
    or that is tied to the embedding); otherwise the plain copy is dropped.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_weight: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_nbytes = weight.nbytes  # what one forward reads
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)  # opaque mkldnn tensor
        self.bias = None if bias is None else bias.detach()
        self.weight = weight.detach() if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) bf16 -> (..., out) bf16; any leading shape, like F.linear. Runs `padded_rows` rows."""
        rows = x.numel() // self.in_features
        padded = padded_rows(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        flat = F.pad(x.reshape(rows, self.in_features), (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out[:rows].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


@torch.no_grad()
def pack_linears(module: nn.Module, keep_weights: tuple[str, ...] = ()) -> int:
    """Replace every `nn.Linear` under `module` by a `PackedLinear`, in place; returns how many.

    keep_weights: attribute names (e.g. "lm_head") whose plain weight other modules still read.
    """
    return replace_linears(module, lambda name, child: PackedLinear(child.weight, child.bias,
                                                                     keep_weight=name in keep_weights))


def replace_linears(module: nn.Module, make: Callable[[str, nn.Linear], nn.Module | None]) -> int:
    """Every plain `nn.Linear` under `module` (by its attribute name) replaced, in place, by what
    `make` returns for it (None: kept); returns how many were replaced."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            replacement = make(name, child) if type(child) is nn.Linear else None
            if replacement is not None:
                setattr(parent, name, replacement)
                count += 1
    return count


def pack_for_inference(module: nn.Module, keep_weights: tuple[str, ...] = ()) -> int:
    """`pack_linears` when the module's weights are bf16 on a CPU that can pack them, else nothing;
    returns how many linears were packed."""
    weight = next(module.parameters(), None)
    if weight is None or not can_pack(weight.device, weight.dtype):
        return 0
    return pack_linears(module, keep_weights)


def few_row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias) for inference over a few rows: x (..., in), weight (out, in) -> (..., out).

    In float32 on a CPU, MKL multiplies x @ weight^T 2-3x more slowly at 4-32 rows than the same
    product ordered weight @ x^T (an 8192 x 576 draft vocabulary on AVX2: 3.3 -> 1.2 ms at 4 rows;
    `bench/cpu_linear.py --few-rows`). Elsewhere (CUDA, bf16, autograd, more than `FEW_ROWS` rows)
    this is `F.linear`. The two orders differ in rounding only.
    """
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled() or rows > FEW_ROWS:
        return F.linear(x, weight)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).T)  # (out, M)
    return out.T.reshape(*x.shape[:-1], weight.shape[0])


def apply_few_rows(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` for a bias-free output layer (`nn.Linear` or `PackedLinear`), through `few_row_linear`
    where the layer is a plain `nn.Linear`."""
    if type(layer) is nn.Linear and layer.bias is None:
        return few_row_linear(x, layer.weight)
    return layer(x)


class Int8Linear(nn.Module):
    """Bias-free `F.linear(x, weight)`, approximately: the weight stored as int8 with one float
    scale per output row (symmetric), the input rounded to bf16, through torch's weight-only int8
    kernel (`torch._weight_int8pack_mm`, as gpt-fast and torchao use it on CPU). A quarter of the
    float32 weight's bytes to read. For a draft head's logits only (they rank candidate tokens;
    verification is exact): never for the target. Inference only, CPU.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # (out,)
        self.weight_int8 = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scales.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out) float32."""
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        out = torch._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        return out.float().reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def median_ms(fn: Callable[[], object], repeats: int = 7) -> float:
    """The median wall time of `repeats` calls of fn, in ms, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@torch.no_grad()
def fastest_logits_layer(weight: torch.Tensor, rows: tuple[int, ...] = (1, 4)) -> nn.Module | None:
    """The fastest output layer for a draft's logits over a float32 CPU weight (out, in), timed here
    at these row counts (summed; about a millisecond per row count and layer for a draft
    vocabulary): the few-row kernel's `FewRowLinear` (exact; where `few_row_gemm.load` registered
    it), an `Int8Linear` (approximate), or None: `few_row_linear` over the plain weight. On a tie the
    exact layers win. None also on CUDA, in other dtypes, or where neither alternative exists."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    layers: dict[str, nn.Module | None] = {}  # in order of preference on a tie
    if few_row_gemm.loaded():
        layers["kernel"] = few_row_gemm.FewRowLinear(weight)
    layers["plain"] = None
    if hasattr(torch, "_weight_int8pack_mm"):
        layers["int8"] = Int8Linear(weight)
    if len(layers) == 1:
        return None
    xs = [torch.randn(n, weight.shape[1]) for n in rows]

    def cost(layer: nn.Module | None) -> float:
        forward = layer if layer is not None else (lambda x: few_row_linear(x, weight))
        return sum(median_ms(lambda x=x: forward(x)) for x in xs)

    times = {name: cost(layer) for name, layer in layers.items()}
    return layers[min(times, key=times.__getitem__)]  # the first of equal times


def draft_quantization(choice: str, device: str | torch.device, dtype: torch.dtype) -> str:
    """The `draft_model_quantization` knob resolved for a head on `device` in `dtype`: "q8_0" or
    "unquant". auto: q8_0 where the head runs in float32 on a CPU that runs the GGUF kernel (built
    here on first use), else unquant. An explicit q8_0 the head cannot run is an error."""
    if choice == "unquant":
        return choice
    runs = torch.device(device).type == "cpu" and dtype == torch.float32 and gguf_gemm.load()
    if choice == "q8_0" and not runs:
        raise ValueError(f"draft_model_quantization: q8_0 runs on a CPU in float32 with the GGUF kernel "
                         f"(AVX2, FMA, F16C); this head is {dtype} on {device}")
    return "q8_0" if runs else "unquant"


def quantize_linears(module: nn.Module) -> int:
    """Every bias-free float32 `nn.Linear` under `module` whose inputs are whole blocks of 32 becomes
    a `GGUFLinear` on its weight's Q8_0 blocks (`gguf_gemm.quantize_q8_0`); returns how many. For a
    draft head only (lossy); needs `gguf_gemm.load()` first."""

    def quantized(_: str, child: nn.Linear) -> nn.Module | None:
        if child.bias is None and child.weight.dtype == torch.float32 and child.in_features % gguf_gemm.BLOCK == 0:
            return gguf_gemm.GGUFLinear(gguf_gemm.quantize_q8_0(child.weight), gguf_gemm.Q8_0)
        return None

    return replace_linears(module, quantized)
