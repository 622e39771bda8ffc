"""Host-to-device copies of a step's small host values (slots, cache lengths, tokens, tree links)
through one pinned buffer per device, written in place: no pageable copy, which would make the host
wait for the device, and no new pinned allocation per copy.

`to_device(values, device)` writes the values into the next free bytes of the device's ring of
pinned host memory and queues an asynchronous copy from there; the device tensor it returns is
ready for any op queued after it. When the ring is full it starts again from its beginning, after
waiting for the copies queued from the previous lap (a sync about once per `RING_BYTES` of staged
values, thousands of steps), so bytes still being copied are never overwritten.

On a CPU the values become a host tensor (nothing to copy). The "meta" device, which stands in for
a GPU in the capture-guard tests, stages through an unpinned ring (pinning needs CUDA), so a test
can check that every host-to-device copy of a step reads from the ring (`ring_storage`).

This module does not decide what is copied when; callers copy once per step what the step needs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

RING_BYTES = 1 << 22  # 4 MiB: a step stages a few KiB (a 64-row batch of 64-node trees: ~200 KiB)
_ALIGN = 64


class _Ring:
    """One device's pinned staging memory, handed out front to back (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = torch.empty(RING_BYTES, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.offset = 0
        self.lap_done: torch.cuda.Event | None = None  # the previous lap's copies, on CUDA

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of the ring no queued copy still reads."""
        if nbytes > RING_BYTES:
            raise ValueError(f"staging: {nbytes} bytes exceed the {RING_BYTES}-byte ring")
        if self.offset + nbytes > RING_BYTES:
            self._next_lap()
        start = self.offset
        self.offset += -(-nbytes // _ALIGN) * _ALIGN
        return self.host[start : start + nbytes]

    def _next_lap(self) -> None:
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()  # host sync: the last lap's copies have all run
        self.offset = 0


@functools.cache
def _ring(device: torch.device) -> _Ring:
    return _Ring(device)


def ring_storage(device: torch.device) -> torch.UntypedStorage:
    """The host memory `to_device` stages through for `device` (for tests that check copies)."""
    return _ring(torch.device(device)).host.untyped_storage()


def to_device(values: Sequence | torch.Tensor, device: torch.device | str,
              dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (a list, nested lists, or a host tensor) as a tensor on `device`, copied from the
    device's pinned ring without waiting; a host tensor keeps its own dtype."""
    device = torch.device(device)
    src = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return src
    ring = _ring(device)
    staged = ring.take(src.numel() * src.element_size()).view(src.dtype).view(src.shape)
    staged.copy_(src)
    return staged.to(device, non_blocking=True)
