"""Decode and tree-verify attention on a CPU that reads each request's prefix where it lies in the KV cache.

A CPU step of a few new tokens used to gather every request's cached keys and values out of its slot
and concatenate the new tokens' behind them before SDPA: per layer two copies of the whole prefix,
about a third of a 135M model's batch-1 step at a 300-token context. `slot_attention` reads the
prefix's rows in place (any strides), then the new tokens' own K/V, with the new tokens' (B, T, T)
visibility mask: no copy, no (B, 1, T, S + T) mask.

    out (B, T, Hq * D) = slot_attention(q (B, T, Hq, D), k_new, v_new (B, T, Hkv, D),
                                        k_cache, v_cache (slots, Hkv, S, D), slots (B,), cache_lens (B,),
                                        new_mask (B, T, T) bool)

Token t of request b sees entries [0, cache_lens[b]) of slot slots[b] and new token j where
new_mask[b, t, j]; softmax in float32 with scale D^-1/2; a token that sees nothing gets zeros.
q and the new K/V are float32, the cache float32, bfloat16 or float16 (the new K/V are then first rounded
to it, as the cache will keep them). Each token's result is computed the
same way bit for bit whatever else is in the call (`cpu/slot_attention.cpp` says how), so a tree
verification's tokens come out as their decodes would (at one vector width: `isa`).

The op is a torch custom op (`torch.ops.specserve.slot_attention`) with a shape function, which
`torch.export` and AOTInductor compile into a program like any aten op. `reference` is the same in
plain torch (the tests' reference). This module does nothing on CUDA (`tree_attention` serves it)
or on CPUs without AVX2 and FMA (`supported`); it does not write the cache. Measured on a 2-core Zen 5 in a
135M model's compiled step at a 300-token context (`bench/cpu_step.py --load-format gguf --attention
sdpa,auto`): the forward 5.08 -> 3.86 ms at 1 token, 10.33 -> 8.69 ms at 8.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specserve_kernels import cpp_build

SOURCE = Path(__file__).with_name("cpu") / "slot_attention.cpp"
REQUIRED_FLAGS = frozenset({"avx2", "fma", "f16c"})


def _register_fake() -> None:
    @torch.library.register_fake("specserve::slot_attention")
    def _(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          slots: torch.Tensor, cache_lens: torch.Tensor, new_mask: torch.Tensor) -> torch.Tensor:
        b, t, hq, d = q.shape
        return q.new_empty(b, t, hq * d)


_LIBRARY = cpp_build.OpLibrary("specserve_slot_attention", SOURCE, REQUIRED_FLAGS, ["-mavx2", "-mfma", "-mf16c"],
                               "SDPA", _register_fake)


def supported() -> bool:
    """Whether this machine can build and run the op: x86-64 with AVX2 and FMA, g++ and ninja."""
    return _LIBRARY.supported()


def source_digest() -> str:
    """What a compiled program that calls the op depends on: the kernel's source."""
    return _LIBRARY.source_digest()


def load(build_root: Path | None = None) -> bool:
    """Builds the op (once per source and torch version under `build_root`) and registers it; True when
    `torch.ops.specserve.slot_attention` is usable. False, with a warning, where it is not `supported`
    or the build fails. Only the first call of a process builds or loads anything."""
    return _LIBRARY.load(build_root)


def isa() -> str:
    """The vector width the op runs at here: "avx512" where the CPU has AVX-512 F/BW/VL/DQ, else "avx2"
    (`SPECSERVE_ATTENTION_ISA=avx2` in the environment caps it, to compare them on one machine)."""
    return torch.ops.specserve.slot_attention_isa()


def slot_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slots: torch.Tensor, cache_lens: torch.Tensor,
                   new_mask: torch.Tensor) -> torch.Tensor:
    """The op (needs `load()` first); shapes as the module says."""
    return torch.ops.specserve.slot_attention(q, k_new, v_new, k_cache, v_cache, slots, cache_lens, new_mask)


def reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, slots: torch.Tensor, cache_lens: torch.Tensor,
              new_mask: torch.Tensor) -> torch.Tensor:
    """`slot_attention` in plain torch, float32, one request at a time (no bit-for-bit promise)."""
    k_new, v_new = k_new.to(k_cache.dtype), v_new.to(v_cache.dtype)  # as the cache will keep them
    b, t, hq, d = q.shape
    group = hq // k_new.shape[2]
    out = q.new_zeros(b, t, hq, d)
    for r in range(b):
        n = int(cache_lens[r])
        keys = torch.cat([k_cache[slots[r], :, :n].float().transpose(0, 1), k_new[r].float()])  # (n + T, Hkv, D)
        values = torch.cat([v_cache[slots[r], :, :n].float().transpose(0, 1), v_new[r].float()])
        sees = torch.cat([torch.ones(t, n, dtype=torch.bool), new_mask[r]], dim=1)  # (T, n + T)
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # (n + T, Hq, D)
        scores = torch.einsum("thd,shd->hts", q[r].float(), keys) * d**-0.5
        probs = scores.masked_fill(~sees, float("-inf")).softmax(-1).nan_to_num(0.0)  # a row that sees nothing: 0
        out[r] = torch.einsum("hts,shd->thd", probs, values).to(q.dtype)
    return out.reshape(b, t, hq * d)
