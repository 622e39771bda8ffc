"""The GGUF-block matmul (`specserve_kernels.gguf_gemm`), in both packed layouts (the integer one where this
CPU runs it): packing that keeps every weight as GGUF's own dequantization (`gguf.quants` is the oracle),
products against float64 at every row count a step can have, rows bit-identical whatever they are
multiplied with, the integer kernel's instruction sets agreeing bit for bit, SmolLM2's real Q4_1 and Q8_0
tensors, refusals with a message, and the op inside an AOTInductor program. Skipped where the kernel
cannot run."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from specserve_kernels import gguf_gemm
from specserve_kernels.gguf_gemm import FLOAT_LAYOUT, INT_LAYOUT, Q4_0, Q4_1, Q8_0

pytestmark = pytest.mark.skipif(not (gguf_gemm.supported() and gguf_gemm.load()),
                                reason="needs an AVX2 + FMA + F16C CPU, g++ and ninja")

TYPES = [Q4_0, Q4_1, Q8_0]
LAYOUTS = [FLOAT_LAYOUT, INT_LAYOUT]


def skip_unless_runs(qtype: int, layout: int) -> None:
    if layout == INT_LAYOUT and not gguf_gemm.int_layout_runs(qtype):
        pytest.skip(f"this CPU's integer kernel ({gguf_gemm.int_kernel()}) does not serve qtype {qtype}")


def random_blocks(n: int, k: int, qtype: int, seed: int) -> torch.Tensor:
    """Raw GGUF blocks of an (n, k) tensor: random codes, float16 scales of a trained layer's size."""
    g = torch.Generator().manual_seed(seed)
    blocks = k // 32
    raw = torch.randint(0, 256, (n, blocks, gguf_gemm.FILE_BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, blocks, 2, generator=g) * 0.02 - torch.tensor([0.0, 0.01])).half()
    width = 4 if qtype == Q4_1 else 2
    raw[..., :width] = scales[..., : width // 2].contiguous().view(torch.uint8).reshape(n, blocks, width)
    return raw.reshape(n, -1)


def gguf_reference(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """gguf-py's dequantization (what transformers' GGUF loader computes)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(np.ascontiguousarray(dequantize(raw.numpy(), GGMLQuantizationType(qtype))))


def assert_within_float32_sum_error(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """got = x @ weight.T up to the rounding of a float32 sum of K products: each output within
    K * 2^-24 * sum_k |x_k w_k| of the exact (float64) value."""
    k = x.shape[1]
    exact = x.double() @ weight.double().T
    bound = k * 2.0**-24 * (x.double().abs() @ weight.double().abs().T) + 1e-30
    assert ((got.double() - exact).abs() <= bound).all(), ((got.double() - exact).abs() / bound).max()


def assert_within_digit_error(got: torch.Tensor, x: torch.Tensor, raw: torch.Tensor, qtype: int,
                              exact: torch.Tensor | None = None) -> None:
    """got = x @ weight.T (or `exact`) as the integer layout computes it, each output within

        2^-24 * [(K / 32 + 8) * S + 32 * sum_k |m_k x_k| + 1.03 * sum_k |d_k q_k| * max_b(k) |x|]

    of the exact (float64) value, q_k the code less its offset (q - 8 for Q4_0), m_k 0 but for Q4_1,
    S = sum_k (|d_k q_k| + |m_k|) |x_k| (for Q4_0 and Q8_0 that is sum_k |w_k x_k|, the float layout's
    yardstick) and max_b(k) |x| the largest |x| of k's block. Why: the digits represent x within
    s / 2 / 254^2 <= 1.03 * 2^-24 of the block's largest |x| (the last term); the int32 sums are exact;
    each block's term d s (A0 + (A1 + A2 / 254) / 254) takes up to about 6 roundings and the float32 sum
    over K / 32 blocks one per block (the first term, relative to the terms' magnitude S); Q4_1's
    m * sum_k x_k adds the float32 sum of 32 x_k (the second). Tighter than K * 2^-24 * S from K = 64 on."""
    codes, d, m = gguf_gemm.codes_and_scales(raw, qtype)
    q = codes.double() - (8 if qtype == Q4_0 else 0)
    dq = (q * d.double()[..., None]).abs().reshape(codes.shape[0], -1)  # (n, K)
    mm = (m.double() if qtype == Q4_1 else torch.zeros_like(m.double()))[..., None].abs().expand(q.shape)
    mm = mm.reshape(codes.shape[0], -1)
    k = x.shape[1]
    xa = x.double().abs()
    block_max = xa.reshape(x.shape[0], k // 32, 32).amax(-1).repeat_interleave(32, dim=1)  # (M, K)
    if exact is None:
        exact = x.double() @ gguf_gemm.dequantize(raw, qtype).double().T
    bound = 2.0**-24 * ((k / 32 + 8) * (xa @ (dq + mm).T) + 32 * (xa @ mm.T) + 1.03 * (block_max @ dq.T)) + 1e-30
    assert ((got.double() - exact).abs() <= bound).all(), ((got.double() - exact).abs() / bound).max()


def rounded_product(x: torch.Tensor, raw: torch.Tensor, qtype: int, digits: int) -> torch.Tensor:
    """x @ weight.T (float64) as `digits` digits compute it: the codes' part (d q) times the rounded x, Q4_1's
    m times the sum of x itself."""
    codes, d, m = gguf_gemm.codes_and_scales(raw, qtype)
    weight = gguf_gemm.dequantize(raw, qtype).double()
    offsets = (m.double() if qtype == Q4_1 else torch.zeros_like(m.double()))[..., None].expand(codes.shape)
    offsets = offsets.reshape(weight.shape)
    return digit_rounding(x, digits) @ (weight - offsets).T + x.double() @ offsets.T


def digit_rounding(x: torch.Tensor, digits: int) -> torch.Tensor:
    """x as `digits` int8 digits represent it, per row and block of 32 (float64): s = max |x| / 127 (raised
    to the next float32 while 127 s < max |x|), a_0 = round(x / s), a_j = round(254 (r_{j-1} - a_{j-1}))."""
    m, k = x.shape
    blocks = x.double().reshape(m, k // 32, 32)
    big = blocks.abs().amax(-1, keepdim=True).float()
    s = big / 127
    while (s.double() * 127 < big.double()).any():
        s = torch.where(s.double() * 127 < big.double(), torch.nextafter(s, torch.tensor(float("inf"))), s)
    s = s.double()
    y, rep, scale = torch.where(s > 0, blocks / s, torch.zeros_like(blocks)), torch.zeros_like(blocks), 1.0
    for _ in range(digits):
        a = y.round().clamp(-127, 127)
        rep, y, scale = rep + a * scale, (y - a) * 254, scale / 254
    return (rep * s).reshape(m, k)


@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("qtype", TYPES)
def test_fewer_digits_compute_the_rounded_activations(qtype, digits):
    """With one digit (llama.cpp's 8-bit rounding of each block) or two, the product of the activations as
    those digits round them (Q4_1's m times the sum of the activations themselves), within the three-digit
    kernel's error bound; the rounding is real (the unrounded product is ten times further off)."""
    skip_unless_runs(qtype, INT_LAYOUT)
    raw = random_blocks(100, 576, qtype, seed=digits + qtype)
    packed = gguf_gemm.pack(raw, qtype, INT_LAYOUT)
    g = torch.Generator().manual_seed(digits)
    for m in [1, 3, 4, 5, 8, 9, 16, 17]:
        x = torch.randn(m, 576, generator=g)
        x[:, :32] *= 50
        got = gguf_gemm.gguf_mm(x, packed, 100, qtype, INT_LAYOUT, digits)
        rounded = rounded_product(x, raw, qtype, digits)
        assert_within_digit_error(got, x, raw, qtype, exact=rounded)
        exact = x.double() @ gguf_gemm.dequantize(raw, qtype).double().T
        assert (got.double() - exact).abs().max() > 10 * (got.double() - rounded).abs().max()


def test_the_integer_layout_is_the_default_where_avx512_vnni_runs_it():
    assert torch.ops.specserve.gguf_int_kernel() == gguf_gemm.int_kernel()
    for qtype in TYPES:
        raw = random_blocks(32, 64, qtype, seed=qtype)
        layer = gguf_gemm.GGUFLinear(raw, qtype)
        want = INT_LAYOUT if gguf_gemm.int_kernel() == "avx512" else FLOAT_LAYOUT  # AVX2's is slower at 2+ rows
        assert layer.layout == want
        assert ("int layout" if want == INT_LAYOUT else "float layout") in repr(layer)
        assert gguf_gemm.GGUFLinear(raw, qtype, FLOAT_LAYOUT).layout == FLOAT_LAYOUT  # asked for
    if gguf_gemm.int_kernel().startswith("avx512"):
        assert all(gguf_gemm.int_layout_runs(q) for q in TYPES)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [16, 100, 192])
def test_packing_keeps_every_weight_as_gguf_defines_it(qtype, n, layout):
    """Both layouts, whatever this CPU runs: the packed bytes, `unpack`, and `rows` (the embedding lookup)."""
    raw = random_blocks(n, 576, qtype, seed=n + qtype)
    want = gguf_reference(raw, qtype)
    assert want.shape == (n, 576)
    assert torch.equal(gguf_gemm.dequantize(raw, qtype), want)
    packed = gguf_gemm.pack(raw, qtype, layout)
    assert packed.shape == (-(-n // 16), 18, gguf_gemm.record_bytes(qtype, layout))
    assert torch.equal(gguf_gemm.unpack(packed, n, qtype, layout), want)
    layer = gguf_gemm.GGUFLinear(raw, qtype, layout)
    assert torch.equal(layer.dequantized(), want)
    ids = torch.tensor([0, n - 1, 5, 17 % n, 5])
    assert torch.equal(layer.rows(ids), want[ids])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize(("n", "k"), [(16, 32), (100, 576), (960, 1536), (37, 96)])
def test_matches_float64_at_every_row_count(qtype, n, k, layout):
    skip_unless_runs(qtype, layout)
    raw = random_blocks(n, k, qtype, seed=n * k + qtype)
    weight = gguf_reference(raw, qtype).double()
    packed = gguf_gemm.pack(raw, qtype, layout)
    g = torch.Generator().manual_seed(k)
    for m in [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 33]:
        x = torch.randn(m, k, generator=g)
        x[:, :32] *= 50  # a block of larger activations beside smaller ones
        got = gguf_gemm.gguf_mm(x, packed, n, qtype, layout)
        assert got.shape == (m, n)
        if layout == INT_LAYOUT:
            assert_within_digit_error(got, x, raw, qtype)
        else:
            assert_within_float32_sum_error(got, x, weight)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_and_non_finite_activations(layout):
    raw = random_blocks(40, 96, Q4_1, seed=3)
    packed = gguf_gemm.pack(raw, Q4_1, layout)
    x = torch.randn(3, 96)
    x[0] = 0.0
    x[1, 40] = float("inf")
    x[2, 33:64] = 0.0  # an all-zero block inside a row
    got = gguf_gemm.gguf_mm(x, packed, 40, Q4_1, layout)
    assert torch.equal(got[0], torch.zeros(40))
    assert not got[1].isfinite().any()
    assert_within_float32_sum_error(got[2:], x[2:], gguf_reference(raw, Q4_1))


@pytest.mark.parametrize(("layout", "digits"), [(FLOAT_LAYOUT, 3), (INT_LAYOUT, 3), (INT_LAYOUT, 2), (INT_LAYOUT, 1)])
@pytest.mark.parametrize("qtype", TYPES)
def test_a_row_is_computed_the_same_whatever_rows_come_with_it(qtype, layout, digits):
    """A verification's rows equal the decode steps' bit for bit: the same operations per output (with one
    digit a pass takes up to 12 rows, so 25 rows cover three passes of every width)."""
    skip_unless_runs(qtype, layout)
    raw = random_blocks(300, 576, qtype, seed=7)
    packed = gguf_gemm.pack(raw, qtype, layout)
    x = torch.randn(25, 576, generator=torch.Generator().manual_seed(1))

    def mm(rows: torch.Tensor) -> torch.Tensor:
        return gguf_gemm.gguf_mm(rows, packed, 300, qtype, layout, digits)

    alone = torch.cat([mm(x[i : i + 1]) for i in range(25)])
    for m in range(1, 26):
        assert torch.equal(mm(x[:m]), alone[:m]), m
        assert torch.equal(mm(x[25 - m :]), alone[25 - m :]), m


_ISA_SCRIPT = """
import sys, torch
from specserve_kernels import gguf_gemm
assert gguf_gemm.load()
data = torch.load(sys.argv[1])
out = {}
for qtype, raw in data["raws"].items():
    if gguf_gemm.int_layout_runs(qtype):
        out[qtype] = [gguf_gemm.gguf_mm(data["x"], gguf_gemm.pack(raw, qtype, 1), raw.shape[0], qtype, 1, digits)
                      for digits in (1, 2, 3)]
    else:
        try:
            gguf_gemm.gguf_mm(data["x"], gguf_gemm.pack(raw, qtype, 1), raw.shape[0], qtype, 1)
        except RuntimeError as e:
            out[qtype] = str(e)
torch.save({"kernel": torch.ops.specserve.gguf_int_kernel(), "out": out}, sys.argv[2])
"""


def test_every_integer_kernel_computes_the_same_bits(tmp_path):
    """The AVX2 (vpmaddubsw), 256-bit and 512-bit VNNI kernels (where this CPU has them, each in a process of
    its own: the choice is made once) do the same float operations per output on exact integer sums."""
    if gguf_gemm.int_kernel() == "none":
        pytest.skip("no integer kernel on this CPU")
    raws = {q: random_blocks(70, 192, q, seed=11 + q) for q in TYPES}
    x = torch.randn(15, 192, generator=torch.Generator().manual_seed(5))  # one digit: 12 rows a pass, then 3
    torch.save({"raws": raws, "x": x}, tmp_path / "in.pt")
    results = {}
    for cap in ["avx2", "avx512-256", ""]:
        env = {**os.environ, "SPECSERVE_GGUF_ISA": cap}
        subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(tmp_path / "in.pt"), str(tmp_path / f"out-{cap}.pt")],
                       env=env, check=True, timeout=600)
        got = torch.load(tmp_path / f"out-{cap}.pt")
        results[got["kernel"]] = got["out"]
    assert "avx2" in results
    for kernel, out in results.items():
        for qtype in TYPES:
            if kernel == "avx2" and qtype == Q8_0:
                assert "no integer kernel" in out[qtype]
                continue
            want = results[gguf_gemm.int_kernel()][qtype]
            assert all(torch.equal(o, w) for o, w in zip(out[qtype], want, strict=True)), (kernel, qtype)


def test_smollm2s_own_tensors(smollm2_gguf):
    """The served GGUF's Q4_1 projection and Q8_0 embedding, through the kernel and through gguf-py."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(smollm2_gguf)).tensors}
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    for name in ("blk.0.ffn_gate.weight", "token_embd.weight"):
        t = tensors[name]
        raw = torch.from_numpy(np.ascontiguousarray(t.data))
        qtype = int(t.tensor_type)
        weight = gguf_reference(raw, qtype)
        for layout in LAYOUTS:
            if layout == INT_LAYOUT and not gguf_gemm.int_layout_runs(qtype):
                continue
            layer = gguf_gemm.GGUFLinear(raw, qtype, layout)
            assert torch.equal(layer.dequantized(), weight)
            if layout == INT_LAYOUT:
                assert_within_digit_error(layer(x), x, raw, qtype)
            else:
                assert_within_float32_sum_error(layer(x), x, weight)
            ids = torch.tensor([0, 17, 5, layer.out_features - 1])
            assert torch.equal(layer.rows(ids), weight[ids])  # an embedding lookup on the blocks


def test_bad_input_is_refused_with_a_message():
    raw = random_blocks(32, 64, Q4_1, seed=0)
    packed = gguf_gemm.pack(raw, Q4_1)
    with pytest.raises(RuntimeError, match="does not match"):
        gguf_gemm.gguf_mm(torch.randn(2, 96), packed, 32, Q4_1)
    with pytest.raises(RuntimeError, match="does not match"):
        gguf_gemm.gguf_mm(torch.randn(2, 64), packed, 32, Q8_0)
    with pytest.raises(RuntimeError, match="float32"):
        gguf_gemm.gguf_mm(torch.randn(2, 64, dtype=torch.float64), packed, 32, Q4_1)
    with pytest.raises(RuntimeError, match="qtype"):
        gguf_gemm.gguf_mm(torch.randn(2, 64), packed, 32, 12)
    with pytest.raises(RuntimeError, match="layout"):
        gguf_gemm.gguf_mm(torch.randn(2, 64), packed, 32, Q4_1, 2)
    with pytest.raises(RuntimeError, match="does not match"):  # Q4_0's integer records are 288 bytes
        gguf_gemm.gguf_mm(torch.randn(2, 64), gguf_gemm.pack(random_blocks(32, 64, Q4_0, seed=0), Q4_0), 32, Q4_0,
                          INT_LAYOUT)
    for digits in (0, 4):
        with pytest.raises(RuntimeError, match="digits must be 1, 2 or 3"):
            gguf_gemm.gguf_mm(torch.randn(2, 64), packed, 32, Q4_1, FLOAT_LAYOUT, digits)
    with pytest.raises(ValueError, match="layout"):
        gguf_gemm.pack(raw, Q4_1, 5)
    with pytest.raises(ValueError, match="Q4_0"):
        gguf_gemm.pack(raw, 14)  # Q6_K: not a type this kernel reads
    with pytest.raises(ValueError, match="raw blocks"):
        gguf_gemm.pack(raw[:, :-1], Q4_1)


class _Tiny(nn.Module):
    def __init__(self, layout: int | None) -> None:
        super().__init__()
        self.proj = gguf_gemm.GGUFLinear(random_blocks(64, 64, Q4_1, seed=1), Q4_1, layout)
        self.head = gguf_gemm.GGUFLinear(random_blocks(50, 64, Q8_0, seed=2), Q8_0, layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.silu(self.proj(x)))


@pytest.mark.parametrize("layout", [FLOAT_LAYOUT, None])  # None: the default, the integer one where it runs
def test_the_op_compiles_into_an_aoti_program(tmp_path, layout):
    model = _Tiny(layout).eval()
    x = torch.randn(2, 3, 64)
    rows = torch.export.Dim("rows", min=1, max=16)
    with torch.no_grad():
        program = torch.export.export(model, (x,), dynamic_shapes=({1: rows},), strict=False)
        assert any("gguf_mm" in str(node.target) for node in program.graph.nodes)
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "tiny.pt2"),
                                                         inductor_configs={"freezing": True})
    runner = torch._inductor.aoti_load_package(path)
    with torch.inference_mode():
        for t in (1, 5):
            x = torch.randn(2, t, 64)
            assert torch.equal(runner(x), model(x))
