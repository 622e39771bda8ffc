"""The C library's allocator settings for a serving loop's allocations (glibc on Linux).

Every step of a compiled CPU program allocates the same large buffers and frees them before the
next step: per layer, each request's cached keys and values gathered for attention (batch x
context x KV width: megabytes at batch 8). glibc serves a block above its mmap threshold with a
fresh mapping, and hands freed memory at the top of its heap back to the kernel above its trim
threshold; by default both thresholds move with what the process freed before. So the same step
either reuses heap memory or maps, zero-fills and unmaps every buffer anew, depending on the
process's history: one engine's decode runs at twice another's for the same work, and a tree
size can stay slow for a whole run (docs/performance.md has the figures, measured with `perf` as
page faults and zeroing).

`keep_freed_memory` fixes the thresholds (`mallopt`): blocks up to `MMAP_THRESHOLD` come from the
heap, and freed memory stays there for the next step until more than `TRIM_THRESHOLD` is free at
its top. A process then holds its high-water mark of step buffers instead of returning it.

It changes nothing where the C library is not glibc, or where the user set glibc's own variables
(`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `GLIBC_TUNABLES=glibc.malloc.*`), and knows
nothing about models or devices.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest mmap threshold on 64-bit
TRIM_THRESHOLD = 512 * 2**20
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@functools.cache
def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once); whether they are now ours."""
    if any(v in os.environ for v in USER_VARIABLES) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        log.info("malloc: the environment sets glibc's thresholds; leaving them as they are")
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (raises AttributeError outside glibc)
    except (OSError, AttributeError):
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if ok:
        log.info("malloc: blocks up to %d MiB from the heap, freed memory kept up to %d MiB (glibc mallopt)",
                 MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return ok
