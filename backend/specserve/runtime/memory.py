"""KV-cache slots against a GPU's memory: whether the configured slots fit, and how many would.

The engine allocates its caches once, at load: the target's (`max_batch_size` slots plus a
padding slot, each `max_seq_len` + a tree's spare positions long) and its drafter's (one layer of
the target's shape for an EAGLE / MTP head, a draft model's layers for `standalone`). On CUDA,
before allocating them, `check_kv_cache_fits` compares their bytes plus the largest step's
workspace with what `gpu_memory_utilization` of the device leaves after the weights and every
other process (`torch.cuda.mem_get_info`, as vLLM counts it), and raises a ValueError that says
how many slots fit when the configured number does not, instead of an out-of-memory error
somewhere inside the build. On a CPU nothing is checked (host memory is the OS's to give).

This module allocates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.config import EngineConfig, ModelConfig
from specserve.methods import method


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes of one device: free now and in all (`torch.cuda.mem_get_info`)."""

    free: int
    total: int

    @classmethod
    def of(cls, device: torch.device) -> DeviceMemory | None:
        """The device's memory, or None where there is none to check (CPU, meta)."""
        if device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(device)
        return cls(free=free, total=total)

    def usable(self, utilization: float) -> int:
        """What `utilization` of the device leaves for this engine's caches: its share of the
        total minus what is already in use (the weights, other processes)."""
        return int(self.total * utilization) - (self.total - self.free)


def kv_bytes_per_token(cfg: ModelConfig, num_layers: int, dtype: torch.dtype) -> int:
    """K and V of one token position over `num_layers` layers of `cfg`'s shape."""
    return 2 * num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def draft_kv_bytes_per_token(config: EngineConfig, target: ModelConfig) -> int:
    """The drafter's cache per token position: a head is one layer of the target's shape (the
    EAGLE-3 / EAGLE / MTP layouts keep the target's heads), a standalone draft model its own
    layers (the target's first `standalone_num_layers` when it has no drafter_path)."""
    spec, dtype = config.spec, config.torch_dtype
    m = method(spec.algorithm)
    if m.is_head:
        return kv_bytes_per_token(target, 1, dtype)
    if m.draft_model:
        if spec.drafter_path:
            draft = ModelConfig.from_dir(spec.drafter_path)
            return kv_bytes_per_token(draft, draft.num_layers, dtype)
        return kv_bytes_per_token(target, spec.standalone_num_layers or target.num_layers // 4, dtype)
    return 0


def step_workspace_bytes(config: EngineConfig, target: ModelConfig, tree_tokens: int) -> int:
    """The largest step's transient tensors, roughly: float32 logits over every tree node of a
    full batch, three times (logits, probabilities, the sampling kernel's copy)."""
    return 3 * config.max_batch_size * tree_tokens * target.vocab_size * 4


def check_kv_cache_fits(config: EngineConfig, target: ModelConfig, num_slots: int, max_len: int,
                        tree_tokens: int, memory: DeviceMemory | None) -> None:
    """Raise ValueError (naming max_batch_size) when `num_slots` cache slots of `max_len` positions,
    the drafter's cache and the step workspace do not fit `config.gpu_memory_utilization` of the
    device; the message says how many slots would. `memory` None: nothing to check."""
    if memory is None:
        return
    per_slot = max_len * (kv_bytes_per_token(target, target.num_layers, config.torch_dtype)
                          + draft_kv_bytes_per_token(config, target))
    workspace = step_workspace_bytes(config, target, tree_tokens)
    usable = memory.usable(config.gpu_memory_utilization)
    need = num_slots * per_slot + workspace
    if need <= usable:
        return
    spare = num_slots - config.max_batch_size  # the padding slot(s) the static buckets write into
    fit = max(0, (usable - workspace) // per_slot - spare)
    gib = 2**30
    raise ValueError(
        f"max_batch_size: {config.max_batch_size} requests x {config.max_seq_len} tokens need {need / gib:.2f} GiB "
        f"of KV cache and step workspace on {config.device}, but gpu_memory_utilization {config.gpu_memory_utilization:g} "
        f"of its {memory.total / gib:.1f} GiB leaves {max(usable, 0) / gib:.2f} GiB beside the weights and other "
        f"processes ({(memory.total - memory.free) / gib:.1f} GiB in use): {fit} slots of {config.max_seq_len} tokens "
        "fit; lower max_batch_size or max_seq_len, or raise gpu_memory_utilization"
    )
