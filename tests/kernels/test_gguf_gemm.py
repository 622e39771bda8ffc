"""The GGUF-block matmul (`specserve_kernels.gguf_gemm`): packing that keeps every weight as GGUF's own
dequantization (`gguf.quants` is the oracle), products against float64 at every row count a step can
have, rows bit-identical whatever they are multiplied with, SmolLM2's real Q4_1 and Q8_0 tensors, refusals
with a message, and the op inside an AOTInductor program. Skipped where the kernel cannot run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from specserve_kernels import gguf_gemm
from specserve_kernels.gguf_gemm import Q4_0, Q4_1, Q8_0

pytestmark = pytest.mark.skipif(not (gguf_gemm.supported() and gguf_gemm.load()),
                                reason="needs an AVX2 + FMA + F16C CPU, g++ and ninja")

TYPES = [Q4_0, Q4_1, Q8_0]


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


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [16, 100, 192])
def test_packing_keeps_every_weight_as_gguf_defines_it(qtype, n):
    raw = random_blocks(n, 576, qtype, seed=n + qtype)
    want = gguf_reference(raw, qtype)
    assert want.shape == (n, 576)
    assert torch.equal(gguf_gemm.dequantize(raw, qtype), want)
    packed = gguf_gemm.pack(raw, qtype)
    assert packed.shape == (-(-n // 16), 18, gguf_gemm.RECORD_BYTES[qtype])
    assert torch.equal(gguf_gemm.unpack(packed, n, qtype), want)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize(("n", "k"), [(16, 32), (100, 576), (960, 1536)])
def test_matches_float64_at_every_row_count(qtype, n, k):
    raw = random_blocks(n, k, qtype, seed=n * k + qtype)
    weight = gguf_reference(raw, qtype).double()
    packed = gguf_gemm.pack(raw, qtype)
    g = torch.Generator().manual_seed(k)
    for m in [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 33]:
        x = torch.randn(m, k, generator=g)
        got = gguf_gemm.gguf_mm(x, packed, n, qtype)
        assert got.shape == (m, n)
        assert_within_float32_sum_error(got, x, weight)


@pytest.mark.parametrize("qtype", TYPES)
def test_a_row_is_computed_the_same_whatever_rows_come_with_it(qtype):
    """A verification's rows equal the decode steps' bit for bit: one sequential sum per output."""
    raw = random_blocks(300, 576, qtype, seed=7)
    packed = gguf_gemm.pack(raw, qtype)
    x = torch.randn(17, 576, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([gguf_gemm.gguf_mm(x[i : i + 1], packed, 300, qtype) for i in range(17)])
    for m in range(1, 18):
        assert torch.equal(gguf_gemm.gguf_mm(x[:m], packed, 300, qtype), alone[:m]), m


def test_smollm2s_own_tensors(smollm2_gguf):
    """The served GGUF's Q4_1 projection and Q8_0 embedding, through the kernel and through gguf-py."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(smollm2_gguf)).tensors}
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    for name in ("blk.0.ffn_gate.weight", "token_embd.weight"):
        t = tensors[name]
        raw = torch.from_numpy(np.ascontiguousarray(t.data))
        qtype = int(t.tensor_type)
        layer = gguf_gemm.GGUFLinear(raw, qtype)
        weight = gguf_reference(raw, qtype)
        assert torch.equal(layer.dequantized(), weight)
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
    with pytest.raises(ValueError, match="Q4_0"):
        gguf_gemm.pack(raw, 14)  # Q6_K: not a type this kernel reads
    with pytest.raises(ValueError, match="raw blocks"):
        gguf_gemm.pack(raw[:, :-1], Q4_1)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = gguf_gemm.GGUFLinear(random_blocks(64, 64, Q4_1, seed=1), Q4_1)
        self.head = gguf_gemm.GGUFLinear(random_blocks(50, 64, Q8_0, seed=2), Q8_0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.silu(self.proj(x)))


def test_the_op_compiles_into_an_aoti_program(tmp_path):
    model = _Tiny().eval()
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
