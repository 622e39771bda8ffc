"""The CPU attention that reads each request's prefix in place (`specserve_kernels.slot_attention`):
against its plain-torch reference over random shapes, strides and masks (float32, bfloat16 and float16 caches),
a tree verification's tokens bit for bit as their decodes, a request's result whatever else is in the
call or however many threads share it, refusals with a message, the op inside an AOTInductor program, and
both vector widths. Skipped where it cannot run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve_kernels import slot_attention as SA

pytestmark = pytest.mark.skipif(not (SA.supported() and SA.load()), reason="needs an AVX2 + FMA CPU, g++ and ninja")


def case(b: int, t: int, hkv: int, group: int, d: int, max_len: int, lens: list[int], dtype: torch.dtype,
         seed: int) -> tuple[torch.Tensor, ...]:
    """Random inputs with the layouts the step program hands the op: q a transposed view, the caches a
    view of the first entries of a longer cache, slots in reverse order, a random mask with a true diagonal."""
    g = torch.Generator().manual_seed(seed)
    hq, slots = hkv * group, b + 1
    q = torch.randn(b, hq, t, d, generator=g).transpose(1, 2)
    k_new, v_new = torch.randn(2, b, t, hkv, d, generator=g)
    cache = torch.randn(2, slots, hkv, max_len + 5, d, generator=g).to(dtype)[..., :max_len, :]
    mask = (torch.rand(b, t, t, generator=g) < 0.5) | torch.eye(t, dtype=torch.bool)
    return (q, k_new, v_new, cache[0], cache[1], torch.arange(b, 0, -1), torch.tensor(lens), mask)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 9), hkv=st.integers(1, 3), group=st.integers(1, 4),
       d=st.sampled_from([8, 64, 72, 128]), data=st.data(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_matches_the_reference(b: int, t: int, hkv: int, group: int, d: int, data: st.DataObject,
                               dtype: torch.dtype) -> None:
    max_len = 70
    lens = data.draw(st.lists(st.integers(0, max_len), min_size=b, max_size=b))
    inputs = case(b, t, hkv, group, d, max_len, lens, dtype, seed=b * t + d)
    out = SA.slot_attention(*inputs)
    assert out.shape == (b, t, hkv * group * d) and out.dtype == torch.float32
    torch.testing.assert_close(out, SA.reference(*inputs), atol=2e-6, rtol=2e-5)


def test_a_token_that_sees_nothing_gets_zeros() -> None:
    q, k_new, v_new, kc, vc, slots, lens, mask = case(2, 3, 1, 2, 64, 16, [0, 5], torch.float32, seed=1)
    mask[0, 1] = False  # request 0, token 1: no prefix and no new token
    out = SA.slot_attention(q, k_new, v_new, kc, vc, slots, lens, mask)
    assert torch.equal(out[0, 1], torch.zeros(2 * 64))
    assert out[1].abs().sum() > 0 and out[0, 0].abs().sum() > 0
    torch.testing.assert_close(out, SA.reference(q, k_new, v_new, kc, vc, slots, lens, mask), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_tree_verification_computes_each_token_as_its_decode(dtype: torch.dtype) -> None:
    """A tree of 7 nodes after a 37-entry prefix: each node's output equals, bit for bit, a decode of that
    node alone once its ancestors sit in the cache after the prefix (where acceptance puts them, rounded to
    a 16-bit cache as the op rounds the tree's new K/V)."""
    parents = [-1, 0, 0, 1, 1, 2, 4]  # node 0 the root, then two levels and a third
    t, hkv, group, d, prefix = len(parents), 2, 3, 64, 37
    q, k_new, v_new, kc, vc, _, _, _ = case(1, t, hkv, group, d, 64, [prefix], dtype, seed=3)
    slots, lens = torch.tensor([0]), torch.tensor([prefix])
    mask = torch.zeros(1, t, t, dtype=torch.bool)
    for node in range(t):
        up = node
        while up >= 0:
            mask[0, node, up] = True
            up = parents[up]
    tree = SA.slot_attention(q, k_new, v_new, kc, vc, slots, lens, mask)
    for node in range(t):
        ancestors = [j for j in range(node) if mask[0, node, j]]  # in depth order
        k_dec, v_dec = kc.clone(), vc.clone()
        for depth, j in enumerate(ancestors):
            k_dec[0, :, prefix + depth], v_dec[0, :, prefix + depth] = k_new[0, j], v_new[0, j]
        one = slice(node, node + 1)
        decode = SA.slot_attention(q[:, one], k_new[:, one], v_new[:, one], k_dec, v_dec, slots,
                                   torch.tensor([prefix + len(ancestors)]), torch.ones(1, 1, 1, dtype=torch.bool))
        assert torch.equal(decode[0, 0], tree[0, node]), f"node {node}"


def test_a_request_is_computed_alone_whatever_is_batched_with_it() -> None:
    inputs = case(3, 4, 3, 3, 64, 50, [50, 7, 23], torch.bfloat16, seed=5)
    together = SA.slot_attention(*inputs)
    for r in range(3):
        one = [x[r : r + 1] if i in (0, 1, 2, 5, 6, 7) else x for i, x in enumerate(inputs)]
        assert torch.equal(SA.slot_attention(*one)[0], together[r])


@pytest.mark.parametrize("b, t", [(1, 1), (1, 2), (2, 1), (1, 5)])
def test_a_token_is_computed_alike_on_any_number_of_threads(b: int, t: int) -> None:
    """How many (query head, token) pairs share a task follows the threads and the call's size; a pair's
    result does not (one K/V head serves three query heads, as in SmolLM2)."""
    inputs = case(b, t, 3, 3, 64, 80, [80, 41][:b], torch.float32, seed=11)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            outs.append(SA.slot_attention(*inputs))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.mark.parametrize("bad, message", [
    (dict(slots=torch.tensor([9])), "slot 9 out of range"),
    (dict(cache_lens=torch.tensor([65])), "cache length 65 out of range"),
    (dict(new_mask=torch.ones(1, 2, 2, dtype=torch.int64)), "new_mask must be bool"),
    (dict(q=torch.zeros(1, 2, 6, 64, dtype=torch.bfloat16)), "must be float32"),
    (dict(k_cache=torch.zeros(2, 2, 64, 64, dtype=torch.float16)), "must both be float32, both bfloat16 or both"),
    (dict(k_cache=torch.zeros(2, 2, 64, 64, dtype=torch.float64), v_cache=torch.zeros(2, 2, 64, 64,
                                                                                      dtype=torch.float64)),
     "must both be float32, both bfloat16 or both float16"),
])
def test_refuses_inputs_it_cannot_serve(bad: dict, message: str) -> None:
    q, k_new, v_new, kc, vc, _, _, mask = case(1, 2, 2, 3, 64, 64, [3], torch.float32, seed=7)
    args = dict(q=q, k_new=k_new, v_new=v_new, k_cache=kc, v_cache=vc, slots=torch.tensor([0]),
                cache_lens=torch.tensor([3]), new_mask=mask) | bad
    with pytest.raises(RuntimeError, match=message):
        SA.slot_attention(**args)


def test_runs_inside_an_aot_inductor_program(tmp_path) -> None:
    """Exported with dynamic batch, tokens and cache length, compiled by AOTInductor: the program's
    results equal the eager op's (the cache handed in as a strided view, as the step program does)."""

    class Attend(torch.nn.Module):
        def forward(self, q, k_new, v_new, kv, slots, lens, mask):
            return SA.slot_attention(q * 1.0, k_new, v_new, kv[0], kv[1], slots, lens, mask) + 0.0

    q, k_new, v_new, kc, vc, slots, lens, mask = case(2, 3, 1, 3, 64, 40, [12, 33], torch.float32, seed=9)
    kv = torch.stack([kc, vc])[..., :32, :]  # (2, slots, Hkv, S, D), a view
    lens = torch.tensor([12, 30])
    batch, tokens, keys = torch.export.Dim("b", min=1, max=4), torch.export.Dim("t", min=1, max=8), torch.export.Dim(
        "s", min=2, max=39)
    program = torch.export.export(Attend(), (q, k_new, v_new, kv, slots, lens, mask), strict=False, dynamic_shapes=(
        {0: batch, 1: tokens}, {0: batch, 1: tokens}, {0: batch, 1: tokens}, {3: keys}, {0: batch}, {0: batch},
        {0: batch, 1: tokens, 2: tokens}))
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "attend.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    torch.testing.assert_close(runner(q, k_new, v_new, kv, slots, lens, mask),
                               SA.slot_attention(q, k_new, v_new, kv[0], kv[1], slots, lens, mask), atol=0, rtol=0)


_ISA_SCRIPT = """
import sys, torch
from specserve_kernels import slot_attention as SA
assert SA.load()
inputs = torch.load(sys.argv[1])
torch.save({"isa": SA.isa(), "out": SA.slot_attention(*inputs)}, sys.argv[2])
"""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_both_vector_widths_match_the_reference(tmp_path, dtype: torch.dtype) -> None:
    """The 256-bit (AVX2) and, where this CPU has AVX-512, the 512-bit kernel (each in a process of its own:
    the choice is made once) agree with the reference and with each other to float32 rounding, on both
    16-bit caches (each widened by its own instructions)."""
    inputs = case(2, 5, 3, 3, 64, 90, [90, 41], dtype, seed=13)
    torch.save(inputs, tmp_path / "in.pt")
    results = {}
    for cap in ["avx2", ""]:
        env = {**os.environ, "SPECSERVE_ATTENTION_ISA": cap}
        subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(tmp_path / "in.pt"), str(tmp_path / f"out-{cap}.pt")],
                       env=env, check=True, timeout=600)
        got = torch.load(tmp_path / f"out-{cap}.pt")
        results[got["isa"]] = got["out"]
    assert "avx2" in results and SA.isa() in results
    for out in results.values():
        torch.testing.assert_close(out, SA.reference(*inputs), atol=2e-6, rtol=2e-5)
