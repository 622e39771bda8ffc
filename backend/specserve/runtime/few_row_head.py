"""A draft head's programs for forwards of a few rows, their matmuls chosen for this CPU.

`CompiledHead` runs every forward of a draft head through one program per feature width with
oneDNN's prepacked matmuls, which suit a catch-up over a whole prompt. A drafting step is a few
rows (batch x top-k beam tokens, the accepted tokens' catch-up), where oneDNN's small-M kernels
are far from the memory bound: `FewRowHead` is the same program compiled with the target step
program's settings (`STEP_CONFIGS`: inductor picks, per matmul, its C++ micro-kernel template or
oneDNN by timing them here), or in float32 on an AVX2 CPU with the few-row kernel as its matmuls
(`specserve_kernels.few_row_gemm`). One program per feature width: the beam's (the head's own
hidden size) and the catch-up's over the tokens a step accepted (EAGLE-3: three target layers'
features fused, a width of its own).

The caller picks the program per forward (`rows <= FEW_ROWS`); this module does not.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specserve.models.kv_cache import KVCache
from specserve.runtime.compile_cache import load_or_compile, program_key
from specserve.runtime.compiled import STEP_CONFIGS, STEP_ROWS, CompiledHead, choose_step_matmul
from specserve_kernels import few_row_gemm

FEW_ROWS = STEP_ROWS  # forwards of at most this many rows (batch x tokens) run the few-row program


class FewRowHead(CompiledHead):
    """`CompiledHead` for forwards of a few rows: one program per feature width in `widths`."""

    def __init__(self, head: nn.Module, embed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
                 widths: tuple[int, ...], cache_dir: Path, step_matmul: str = "auto") -> None:
        self.head, self.rope, self.cache = head, rope, cache
        self.step_matmul = choose_step_matmul(head, cache_dir, step_matmul)
        kernel = few_row_gemm.source_digest() if self.step_matmul == "few_row_gemm" else None
        tensors = [*head.state_dict().items(), ("embed", embed)]
        self.runners = {}
        self.compiled_now = False
        for width in sorted(set(widths)):
            key = program_key(tensors, "head-few-rows", width, tuple(cache.data.shape), Path(__file__).read_bytes(),
                              *([kernel] if kernel else []))
            self.runners[width], now = load_or_compile(cache_dir / f"head-rows-{key}.pt2",
                                                       lambda width=width: self._export_rows(width), STEP_CONFIGS)
            self.compiled_now |= now

    def _export_rows(self, width: int) -> torch.export.ExportedProgram:
        if self.step_matmul == "inductor":
            return self._export(width)
        with few_row_gemm.few_row_linears(self.head):
            return self._export(width)

    def covers(self, tokens: torch.Tensor, hidden: torch.Tensor, key_len: int) -> bool:
        """Whether this forward (tokens (B, T), hidden (B, T, F)) is one for these programs."""
        return tokens.numel() <= FEW_ROWS and hidden.shape[-1] in self.runners and self.fits(key_len)
