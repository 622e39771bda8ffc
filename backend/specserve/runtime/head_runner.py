"""A draft head's forwards over its own KV cache, and its whole draft captured per batch size.

`HeadRunner.forward` runs one forward of a one-layer head (EAGLE-2/3, MTP) on the path the plan
allows: on a CPU with compiled programs, the few-row program for forwards of a few rows and the
general program otherwise; else the eager head. A catch-up over many rows runs as few-row chunks
where `chunks_pay` timed that faster at start-up. `draft` runs a drafter's whole draft from a
CUDA graph (or its static bucket) when the plan is static and the shape is the captured one.

This module does not draft: the drafter hands it the head, and the draft function to capture.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from specserve.estimates import time_interleaved
from specserve.models.attention import TORCH_ATTENTION, TRITON_ATTENTION
from specserve.models.cpu_linear import pack_for_inference
from specserve.models.kv_cache import KVCache
from specserve.models.llama import KeyMask, scattered_attention_inputs
from specserve.runtime.compile_cache import compiled_or_none
from specserve.runtime.compiled import CompiledHead
from specserve.runtime.cuda_graph import DraftGraphs
from specserve.runtime.few_row_head import FEW_ROWS, FewRowHead
from specserve.runtime.plan import RuntimePlan
from specserve.staging import to_device
from specserve.tree import TreeBatch

log = logging.getLogger(__name__)

CHUNKED_CATCH_UP_ROWS = 64  # catch-ups of more rows run as one forward (measured a tie beyond, on AVX2)
CATCH_UP_PROBE_ROWS = 32  # the catch-up `chunks_pay` times both ways

Draft = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], TreeBatch]  # (slots, base, roots) (B,) -> trees


class HeadRunner:
    """compiled / few_rows: the head's CPU programs (None without them); graphs: its captured drafts
    (None until `capture_drafts` on a static plan)."""

    def __init__(self, name: str, head: nn.Module, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
                 plan: RuntimePlan, widths: tuple[int, ...]) -> None:
        """widths: the input feature sizes the head's forwards take (the target's features on a
        catch-up, its own states in the beam)."""
        self.name, self.head, self.rope, self.cache, self.plan = name, head, rope, cache, plan
        self.device = plan.device
        # the head's attention: our Triton kernel where the target's runs it (the GPU), else torch
        self.attention = TRITON_ATTENTION if plan.attention == "triton" else TORCH_ATTENTION
        cache_dir = plan.compile_cache_dir
        # the head's forwards compiled from the plain weights, so before they are prepacked
        self.compiled = None if cache_dir is None else compiled_or_none(f"{name} head", lambda: CompiledHead(
            head, head.embed_weight, rope, cache, widths, cache_dir))
        # drafting steps and the catch-ups after them are a few rows: programs with matmuls for a few rows
        self.few_rows = None if self.compiled is None else compiled_or_none(
            f"{name} head (few rows)", lambda: FewRowHead(
                head, head.embed_weight, rope, cache, widths, cache_dir, plan.step_matmul))
        self.chunked_catch_up = self.few_rows is not None and self.chunks_pay()
        pack_for_inference(head)  # bf16 on CPU: the head's linears
        head.pack_logits()  # on CPU: its output layer (bf16: packed; float32: int8 where that is faster here)
        self.graphs: DraftGraphs | None = None

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor,
                mask: KeyMask | None, key_len: int, slots: list[int] | torch.Tensor) -> torch.Tensor:
        """tokens, positions, write_pos (B, T); hidden (B, T, F); mask: the keys each token sees,
        None for a causal fresh prefill; slots: host ints or a (B,) device tensor -> h (B, T, H)."""
        b, t = tokens.shape
        if self.compiled is not None and self.compiled.fits(key_len):
            if mask is None:
                mask = KeyMask(torch.zeros(b, dtype=torch.int64, device=self.device))
            slots_t = slots if isinstance(slots, torch.Tensor) else to_device(slots, self.device)
            few = self.few_rows is not None and self.few_rows.covers(tokens, hidden, key_len)
            program = self.few_rows if few else self.compiled
            return program.forward(tokens, hidden, positions, write_pos, mask.dense(t, key_len), slots_t)
        a = scattered_attention_inputs(self.rope, positions, write_pos, slots, mask, key_len, self.attention)
        layer_cache = self.cache.layer(0)
        return self.head(tokens, hidden, lambda attn, x: attn(x, layer_cache, a))

    def chunks(self, b: int, t: int) -> list[tuple[int, int]]:
        """A catch-up's columns [a, z) per forward: all at once, or few-row chunks (`chunked_catch_up`)."""
        width = FEW_ROWS // b
        if not self.chunked_catch_up or width == 0 or b * t <= FEW_ROWS or b * t > CHUNKED_CATCH_UP_ROWS:
            return [(0, t)]
        return [(a, min(a + width, t)) for a in range(0, t, width)]

    def chunks_pay(self, rows: int = CATCH_UP_PROBE_ROWS, repeats: int = 3) -> bool:
        """Whether a catch-up of `rows` rows runs faster as few-row forwards than as one forward of
        the general program, timed on this CPU (the median of `repeats` each, interleaved, after one
        untimed run; `estimates.time_interleaved`) in
        slot 0's first `rows` cache entries, which it gives back as it found them."""
        assert self.compiled is not None and self.few_rows is not None
        feature_size = self.head.cfg.feature_size
        tokens = torch.zeros(1, rows, dtype=torch.int64, device=self.device)
        feats = torch.zeros(1, rows, feature_size, dtype=self.cache.data.dtype, device=self.device)
        positions = torch.arange(rows, device=self.device)[None]
        slots = torch.zeros(1, dtype=torch.int64, device=self.device)
        if not (self.compiled.fits(rows) and self.few_rows.covers(tokens[:, :FEW_ROWS], feats[:, :FEW_ROWS], rows)):
            return False

        def run(program, width: int) -> None:  # noqa: ANN001
            for a in range(0, rows, width):
                z = min(a + width, rows)
                mask = KeyMask(torch.tensor([a], device=self.device)).dense(z - a, z)
                program.forward(tokens[:, a:z], feats[:, a:z], positions[:, a:z], positions[:, a:z], mask, slots)

        with torch.inference_mode():
            entries = self.cache.data[:, :, 0, :, :rows].clone()  # (layers, 2, kv heads, rows, head dim)
            timings = time_interleaved({"whole": lambda: run(self.compiled, rows),
                                        "chunked": lambda: run(self.few_rows, FEW_ROWS)},
                                       repeats, untimed=1, threads=torch.get_num_threads())
            self.cache.data[:, :, 0, :, :rows] = entries
        whole, chunked = timings["whole"], timings["chunked"]
        log.info("%s drafter: a %d-row catch-up takes %s in one forward, %s in %d-row forwards: %s",
                 self.name, rows, whole, chunked, FEW_ROWS,
                 "chunked" if chunked.median_s < whole.median_s else "one forward")
        return chunked.median_s < whole.median_s

    # ---- whole drafts ---------------------------------------------------------------------------

    def capture_drafts(self, draft: Draft, shape: object) -> None:
        """On a static plan: `draft` (the drafter's draft of `shape` with keys over the whole cache
        slot, tensors only) in one bucket per batch size, captured on CUDA."""
        if self.plan.static:
            self.graphs = DraftGraphs(draft, shape, self.plan.batch_sizes, self.cache.reserve(), self.device,
                                      self.plan.capture)

    def draft(self, shape: object, slots: list[int], base: list[int], roots: list[int]) -> TreeBatch | None:
        """The captured draft's trees when `shape` is the captured one and a bucket holds the
        batch, else None (the drafter drafts eagerly)."""
        return None if self.graphs is None else self.graphs(shape, slots, base, roots)
