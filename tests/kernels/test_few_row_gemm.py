"""The AVX2 few-row matmul (`specserve_kernels.few_row_gemm`) against torch: every row count a step
can have, output widths that are not a multiple of the panel, rows bit-identical whatever they are
multiplied with, bf16 storage giving the float32 products bit for bit, `FewRowLinear` as `nn.Linear`, the swap for an
export, and the op inside an AOTInductor program. Skipped where the kernel cannot run (no AVX2 / FMA, no g++ or
ninja)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve_kernels import few_row_gemm

pytestmark = pytest.mark.skipif(not (few_row_gemm.supported() and few_row_gemm.load()),
                                reason="needs an AVX2 + FMA CPU, g++ and ninja")


@pytest.mark.parametrize("n", [16, 100, 960])
@pytest.mark.parametrize("k", [1, 64, 577])
def test_matches_torch_at_every_row_count(n, k):
    g = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=g)
    packed = few_row_gemm.pack(weight)
    assert packed.shape == (-(-n // 16), k, 16)
    for m in range(0, 18):
        x = torch.randn(m, k, generator=g)
        got = few_row_gemm.few_row_mm(x, packed, n)
        assert got.shape == (m, n)
        torch.testing.assert_close(got, x @ weight.T, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got, few_row_gemm.few_row_mm_reference(x, packed, n), rtol=1e-5, atol=1e-4)


def test_a_row_is_computed_the_same_whatever_rows_come_with_it():
    """A verification's rows equal the decode steps' bit for bit: one sequential sum per output."""
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(300, 576, generator=g), torch.randn(16, 576, generator=g)
    packed = few_row_gemm.pack(weight)
    alone = torch.cat([few_row_gemm.few_row_mm(x[i : i + 1], packed, 300) for i in range(16)])
    for m in range(1, 17):
        assert torch.equal(few_row_gemm.few_row_mm(x[:m], packed, 300), alone[:m]), m


@pytest.mark.parametrize(("n", "k"), [(16, 1), (100, 64), (960, 577)])
def test_bf16_storage_gives_the_float32_products_bit_for_bit(n, k):
    """A bf16 checkpoint served in float32: its weights stored in bf16 (half the bytes) multiply the
    same float32 values in the same order."""
    g = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=g).bfloat16().float()
    as_float, as_bf16 = few_row_gemm.pack(weight), few_row_gemm.pack(weight, torch.bfloat16)
    assert as_bf16.dtype == torch.bfloat16 and as_bf16.shape == as_float.shape
    assert (torch.equal(few_row_gemm.unpack(as_bf16, n), weight)
            and torch.equal(few_row_gemm.unpack(as_float, n), weight))
    for m in range(0, 18):
        x = torch.randn(m, k, generator=g)
        assert torch.equal(few_row_gemm.few_row_mm(x, as_bf16, n), few_row_gemm.few_row_mm(x, as_float, n)), m


def test_bf16_storage_only_where_it_is_exact():
    exact = torch.randn(20, 32).bfloat16().float()
    assert few_row_gemm.bf16_exact(exact) and not few_row_gemm.bf16_exact(exact + 1e-4)
    assert few_row_gemm.FewRowLinear(_linear(exact).weight).packed.dtype == torch.bfloat16
    assert few_row_gemm.FewRowLinear(_linear(exact + 1e-4).weight).packed.dtype == torch.float32
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        few_row_gemm.pack(exact, torch.float16)


def _linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    return linear


def test_non_contiguous_rows_are_read_correctly():
    weight, x = torch.randn(48, 32), torch.randn(32, 6).T  # (6, 32), transposed storage
    torch.testing.assert_close(few_row_gemm.few_row_mm(x, few_row_gemm.pack(weight), 48), x @ weight.T)


def test_mismatched_shapes_are_refused_with_a_message():
    packed = few_row_gemm.pack(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="does not match"):
        few_row_gemm.few_row_mm(torch.randn(2, 63), packed, 32)
    with pytest.raises(RuntimeError, match="float32"):
        few_row_gemm.few_row_mm(torch.randn(2, 64, dtype=torch.float64), packed, 32)
    with pytest.raises(RuntimeError, match="bf16 panels"):
        few_row_gemm.few_row_mm(torch.randn(2, 64), packed.half(), 32)


@pytest.mark.parametrize("bias", [False, True])
def test_few_row_linear_is_nn_linear(bias):
    linear = nn.Linear(40, 70, bias=bias)
    x = torch.randn(2, 3, 40)
    with torch.inference_mode():
        torch.testing.assert_close(few_row_gemm.FewRowLinear(linear.weight, linear.bias)(x), linear(x),
                                   rtol=1e-5, atol=1e-5)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.proj = nn.Linear(32, 32, bias=True)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as SmolLM2's lm_head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(F.silu(self.proj(self.embed(tokens))))


def test_linears_are_swapped_for_the_block_and_put_back():
    model = _Tiny().eval()
    originals = (model.proj, model.head)
    tokens = torch.tensor([[1, 7, 3]])
    want = model(tokens)
    with few_row_gemm.few_row_linears(model) as swapped:
        assert swapped == 2 and isinstance(model.head, few_row_gemm.FewRowLinear)
        torch.testing.assert_close(model(tokens), want, rtol=1e-5, atol=1e-5)
    assert (model.proj, model.head) == originals


def test_the_op_compiles_into_an_aoti_program(tmp_path):
    model = _Tiny().eval()
    tokens = torch.tensor([[1, 7, 3], [4, 4, 2]])
    rows = torch.export.Dim("rows", min=1, max=16)
    with torch.no_grad(), few_row_gemm.few_row_linears(model):
        program = torch.export.export(model, (tokens,), dynamic_shapes=({1: rows},), strict=False)
        assert any("few_row_mm" in str(node.target) for node in program.graph.nodes)
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "tiny.pt2"),
                                                         inductor_configs={"freezing": True})
    runner = torch._inductor.aoti_load_package(path)
    with torch.inference_mode():
        for t in (1, 5):
            x = torch.randint(0, 50, (2, t))
            torch.testing.assert_close(runner(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_load(tmp_path):
    """torch leaves its build directory's `lock` behind when the building process is killed; the
    next process to load the op must not wait on it forever."""
    code = "import sys; from pathlib import Path; from specserve_kernels import few_row_gemm; " \
           "sys.exit(0 if few_row_gemm.load(Path(sys.argv[1])) else 1)"
    run = [sys.executable, "-c", code, str(tmp_path)]
    subprocess.run(run, check=True, timeout=600)  # builds
    (build_dir,) = tmp_path.glob("few_row_gemm-*")
    (build_dir / "lock").touch()  # as a build killed midway leaves it
    subprocess.run(run, check=True, timeout=120)
