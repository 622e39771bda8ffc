"""How forwards run on an engine's device, decided once from its config (`RuntimePlan`).

- static: decode, tree-verify and draft forwards run in fixed-shape buckets whose padding rows
  write into a spare cache slot (`graph_mode` static, or auto on CUDA);
- capture: those buckets are captured as CUDA graphs and replayed (auto on CUDA);
- compile: on a CPU, forwards run through compiled programs (`cpu_compile`), cached on disk;
- fused_kernels: on a GPU, the target's layers run their small ops as fused Triton kernels. The
  "meta" device (shapes only) stands in for a GPU in the capture-guard tests.

The target's runner (`runtime.target`), each draft head's (`runtime.head_runner`) and a standalone
draft model's (`runtime.draft_model`) read this plan. The engine and the drafters never ask which
path a forward takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.config import EngineConfig
from specserve.models.attention import resolve_attention
from specserve.runtime.compile_cache import can_compile
from specserve.runtime.cuda_graph import default_batch_sizes


@dataclass(frozen=True)
class RuntimePlan:
    """batch_sizes: the static buckets' batch sizes (empty unless static); compile_cache_dir: where
    compiled CPU programs live (None: no compiled programs); step_matmul, step_attention: their few-row
    programs' matmuls and attention."""

    device: torch.device
    static: bool = False
    capture: bool = False
    batch_sizes: tuple[int, ...] = ()
    compile_cache_dir: Path | None = None
    step_matmul: str = "auto"
    step_attention: str = "auto"  # the CPU step program's: auto = the in-place kernel where it runs, sdpa
    fused_kernels: bool = False
    attention: str = "torch"  # the resolved attention backend (`models.attention.resolve_attention`)

    @classmethod
    def from_config(cls, config: EngineConfig) -> RuntimePlan:
        device = torch.device(config.device)
        cuda = device.type == "cuda"
        static = config.graph_mode == "static" or (config.graph_mode == "auto" and cuda)
        max_bs = min(config.cuda_graph_max_bs or config.max_batch_size, config.max_batch_size)
        compile_cpu = config.cpu_compile and not static and can_compile(device)
        return cls(
            device=device,
            static=static,
            capture=static and cuda and config.graph_mode == "auto",
            batch_sizes=default_batch_sizes(max_bs) if static else (),
            compile_cache_dir=config.compile_cache_path if compile_cpu else None,
            step_matmul=config.step_matmul,
            step_attention="auto" if config.attention_backend == "auto" else "sdpa",
            fused_kernels=cls.fused_on(device),
            attention=resolve_attention(config.attention_backend, device, config.torch_dtype),
        )

    @staticmethod
    def fused_on(device: torch.device) -> bool:
        """Whether the target's layers run fused Triton kernels on `device` (a GPU, or "meta" for it)."""
        return device.type in ("cuda", "meta")

    @property
    def spare_slots(self) -> int:
        """Cache slots beyond the requests': one for static buckets' padding rows."""
        return int(self.static)
