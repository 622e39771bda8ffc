"""A draft head's program for forwards of a few rows, its matmuls autotuned on this CPU.

`CompiledHead` runs every forward of a draft head through one program per feature width with
oneDNN's prepacked matmuls, which suit a catch-up over a whole prompt. A drafting step is a few
rows (batch x top-k beam tokens, the accepted tokens' catch-up), where oneDNN's small-M kernels
are far from the memory bound: `FewRowHead` is the same program compiled with the target step
program's settings (`STEP_CONFIGS`: inductor picks, per matmul, its C++ micro-kernel template or
oneDNN by timing them here), for the width the beam reads (the head's own hidden size).

The caller picks the program per forward (`rows <= FEW_ROWS`); this module does not.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specserve.models.compiled import STEP_CONFIGS, STEP_ROWS, CompiledHead, load_or_compile, program_key
from specserve.models.kv_cache import KVCache

FEW_ROWS = STEP_ROWS  # forwards of at most this many rows (batch x tokens) run the few-row program


class FewRowHead(CompiledHead):
    """`CompiledHead` for one width (the beam's), its matmuls autotuned for a few rows."""

    def __init__(self, head: nn.Module, embed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
                 width: int, cache_dir: Path) -> None:
        self.head, self.rope, self.cache, self.width = head, rope, cache, width
        tensors = [*head.state_dict().items(), ("embed", embed)]
        key = program_key(tensors, "head-few-rows", width, tuple(cache.data.shape), Path(__file__).read_bytes())
        runner, self.compiled_now = load_or_compile(cache_dir / f"head-rows-{key}.pt2", lambda: self._export(width),
                                                    STEP_CONFIGS)
        self.runners = {width: runner}

    def covers(self, tokens: torch.Tensor, hidden: torch.Tensor, key_len: int) -> bool:
        """Whether this forward (tokens (B, T), hidden (B, T, F)) is one for this program."""
        return tokens.numel() <= FEW_ROWS and hidden.shape[-1] == self.width and self.fits(key_len)
