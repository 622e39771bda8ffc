"""KV-cache slots against a device's memory: whether the configured slots fit, and how many would.

The engine allocates its caches once, at load: the target's (`max_batch_size` slots plus a
padding slot, each `max_seq_len` + a tree's spare positions long) and its drafter's (one layer of
the target's shape for an EAGLE / MTP head, a draft model's layers for `standalone`). Before
allocating them, `check_kv_cache_fits` compares their bytes plus the largest step's workspace and
the copies of the target's weights still to come (`weight_copies`: a compiled CPU program holds its
own, `compiled_weight_copies`) with the memory left, and raises a ValueError that says how many
slots fit when the configured number does not, instead of an out-of-memory error somewhere inside
the build. What is in use already is measured, not counted: the engine's own weights (loaded
before the check) and every other process's, and, while a server upgrades to its compiled
programs, the engine that still serves.

On CUDA the memory left is what `gpu_memory_utilization` of the device leaves
(`torch.cuda.mem_get_info`, as vLLM counts it). On a CPU it is the host's available memory
(`/proc/meminfo`'s MemAvailable, within a cgroup's limit). A meta device is not checked.

This module allocates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specserve.config import EngineConfig
from specserve.model_config import ModelConfig

if TYPE_CHECKING:
    from specserve.runtime.plan import RuntimePlan

GIB = 2**30
COMPILED_TARGET_PROGRAMS = 2  # a compiled target: its prefill and its step program, each with its weights
# cgroup v2 and v1: (limit, usage, the memory.stat line of the reclaimable page cache inside the usage)
CGROUP_FILES = (("memory.max", "memory.current", "file"),
                ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_cache"))


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes of one device: free now and in all (`torch.cuda.mem_get_info`); `host`: the host's
    memory, where all that is free is usable (`gpu_memory_utilization` is a GPU's share)."""

    free: int
    total: int
    host: bool = False

    @classmethod
    def of(cls, device: torch.device) -> DeviceMemory | None:
        """The device's memory (a CPU's is the host's, `host_memory`), or None where there is none
        to check (meta)."""
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return cls(free=free, total=total)
        if device.type == "cpu":
            return host_memory()
        return None

    def usable(self, utilization: float) -> int:
        """What is left for this engine's caches: on a GPU `utilization`'s share of the total minus
        what is already in use (the weights, other processes); on the host all that is free."""
        if self.host:
            return self.free
        return int(self.total * utilization) - (self.total - self.free)


def host_memory(meminfo: Path = Path("/proc/meminfo"),
                cgroup: Path = Path("/sys/fs/cgroup")) -> DeviceMemory | None:
    """The host's memory available to this process: MemAvailable of MemTotal, or less within a
    cgroup's (a container's) limit; None where /proc/meminfo cannot be read (not Linux)."""
    try:
        info = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        total, free = (int(info[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
    except (OSError, KeyError, ValueError):
        return None
    limited = cgroup_memory(cgroup)
    if limited is not None and limited[1] < total:
        free, total = min(free, limited[0]), limited[1]
    return DeviceMemory(free=free, total=total, host=True)


def cgroup_memory(root: Path) -> tuple[int, int] | None:
    """(free, limit) bytes of the cgroup this process sees at `root` (v2, else v1): its limit
    minus its usage, the page cache in it counted as free (the kernel reclaims it); None where
    there is no limit to read."""
    for limit_file, usage_file, cache_key in CGROUP_FILES:
        try:
            limit = (root / limit_file).read_text().strip()
            if limit == "max":
                return None
            usage = int((root / usage_file).read_text())
            stat_lines = (root / limit_file).with_name("memory.stat").read_text().splitlines()
            stat = dict(line.split() for line in stat_lines)
            return int(limit) - usage + int(stat.get(cache_key, 0)), int(limit)
        except (OSError, ValueError):
            continue
    return None


def kv_bytes_per_token(cfg: ModelConfig, num_layers: int, dtype: torch.dtype) -> int:
    """K and V of one token position over `num_layers` layers of `cfg`'s shape."""
    return 2 * num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One copy of a model of `cfg`'s shape in `dtype`: embeddings, layers (attention with its
    biases where it has them, MLP, norms), final norm and an untied lm_head."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = h * (q + 2 * kv) + q * h + (q + 2 * kv) * cfg.attention_bias
    layer = attention + 3 * h * cfg.intermediate_size + 2 * h
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return (embeddings + cfg.num_layers * layer + h) * dtype.itemsize


def compiled_weight_copies(plan: RuntimePlan) -> int:
    """Copies of the target's weights an engine of `plan` allocates after the check: one per
    compiled target program (each holds its weights as constants), none where it runs eagerly.
    Within an embedding table: the prefill program leaves out an untied lm_head, the step program
    holds a tied one apart from the embeddings. A draft head's programs (a head's weights and the
    embeddings) are not counted."""
    return COMPILED_TARGET_PROGRAMS if plan.compile_cache_dir is not None else 0


def draft_kv_bytes_per_token(config: EngineConfig, target: ModelConfig) -> int:
    """The drafter's cache per token position: a head is one layer of the target's shape (the
    EAGLE-3 / EAGLE / MTP layouts keep the target's heads), a standalone draft model its own
    layers (the target's first `standalone_num_layers` when it has no drafter_path)."""
    spec, dtype = config.spec, config.torch_dtype
    m = spec.method
    if m.runs_head:
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
                        tree_tokens: int, memory: DeviceMemory | None, weight_copies: int = 0) -> None:
    """Raise ValueError (naming max_batch_size) when `num_slots` cache slots of `max_len` positions,
    the drafter's cache, the step workspace and `weight_copies` more copies of the target's weights
    (beside the one loaded already: `compiled_weight_copies`) do not fit what `memory` leaves; the
    message says how many slots would. `memory` None: nothing to check."""
    if memory is None:
        return
    per_slot = max_len * (kv_bytes_per_token(target, target.num_layers, config.kv_torch_dtype)
                          + draft_kv_bytes_per_token(config, target))
    weights = weight_copies * weight_bytes(target, config.torch_dtype)
    fixed = step_workspace_bytes(config, target, tree_tokens) + weights
    usable = memory.usable(config.gpu_memory_utilization)
    need = num_slots * per_slot + fixed
    if need <= usable:
        return
    spare = num_slots - config.max_batch_size  # the padding slot(s) the static buckets write into
    fit = max(0, (usable - fixed) // per_slot - spare)
    raise ValueError(too_many_slots(config, memory, need, usable, fit, weight_copies))


def too_many_slots(config: EngineConfig, memory: DeviceMemory, need: int, usable: int, fit: int,
                   weight_copies: int) -> str:
    """The check's error: what the configured slots need, what is left, and how many slots fit."""
    needed = (f"KV cache, step workspace and {weight_copies} compiled copies of the weights" if weight_copies
              else "KV cache and step workspace")
    head = (f"max_batch_size: {config.max_batch_size} requests x {config.max_seq_len} tokens "
            f"need {need / GIB:.2f} GiB")
    fits = f"{fit} slots of {config.max_seq_len} tokens fit; lower max_batch_size or max_seq_len"
    if memory.host:
        return (f"{head} of {needed} in host memory, but {max(usable, 0) / GIB:.2f} GiB of its "
                f"{memory.total / GIB:.1f} GiB are available: {fits}, or free host memory")
    return (
        f"{head} of {needed} on {config.device}, but gpu_memory_utilization "
        f"{config.gpu_memory_utilization:g} of its {memory.total / GIB:.1f} GiB leaves "
        f"{max(usable, 0) / GIB:.2f} GiB beside the weights and other processes "
        f"({(memory.total - memory.free) / GIB:.1f} GiB in use): {fits}, or raise gpu_memory_utilization"
    )
