"""A static KV cache: allocated once, `num_slots × max_len` token entries per layer.

A request owns one slot for its lifetime; its tokens sit at positions [0, cache_len) of that slot.
Its numbers may be narrower than the model's (`kv_cache_dtype`): written entries are rounded to them.
This module only allocates, hands out and copies slots' entries; the model writes entries,
verification compacts them, and `engine.prefix_cache` decides which slot a request takes.
"""

from __future__ import annotations

import logging

import torch

from specserve.model_config import ModelConfig

log = logging.getLogger(__name__)


class KVCache:
    """Shape: data (num_layers, 2, num_slots, num_kv_heads, max_len, head_dim), [k, v] on dim 1."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device: str) -> None:
        self.num_slots, self.max_len = num_slots, max_len
        shape = (cfg.num_layers, 2, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(num_slots))
        log.info(
            "KV cache: %d slots x %d tokens x %d layers = %.1f MiB (%s)",
            num_slots, max_len, cfg.num_layers, self.nbytes / 2**20, dtype,
        )

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of layer i, each (num_slots, num_kv_heads, max_len, head_dim)."""
        return self.data[i, 0], self.data[i, 1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> list[int]:
        """The free slots, lowest first."""
        return sorted(self._free)

    def allocate(self, slot: int | None = None) -> int:
        """`slot` (which must be free), or the lowest free slot, so a batch's slots tend to be
        consecutive (read as a view)."""
        if slot is not None:
            self._free.remove(slot)
            return slot
        self._free.sort()
        return self._free.pop(0)

    def reserve(self) -> int:
        """Take the highest free slot out of circulation for good (CUDA graphs' padding rows)."""
        self._free.sort()
        return self._free.pop()

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} freed twice"
        self._free.append(slot)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Entries [0, n) of slot `src` into slot `dst`, every layer, on the device (no host sync)."""
        if n > 0 and src != dst:
            self.data[:, :, dst, :, :n] = self.data[:, :, src, :, :n]
