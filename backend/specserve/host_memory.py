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

It changes nothing where the C library is not glibc, or where the user set these thresholds
(`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, or their `GLIBC_TUNABLES` names
`glibc.malloc.mmap_threshold` / `glibc.malloc.trim_threshold`).

A decode step reads every weight once, and `none` decoded about 10 % faster and steadier with
the process's memory on 2 MiB pages (docs/cpu.md). Two ways get it there:

- `huge_page_env` gives a process started from here glibc's `glibc.malloc.hugetlb=1`: malloc then
  advises its own mappings and heap to transparent huge pages as it makes them, at no cost (what
  `specserve serve` does for tritonserver and its Python stubs);
- in a process started without it, `back_with_huge_pages` advises the large anonymous mappings made
  so far and collapses them now (`MADV_COLLAPSE`, Linux 6.1+: ~0.3 s per 100 MB at start-up).

Neither does anything where transparent huge pages are off (`never`).

This module knows nothing about models or devices.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest mmap threshold on 64-bit
TRIM_THRESHOLD = 512 * 2**20
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
USER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"


@functools.cache
def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once); whether they are now ours."""
    if any(v in os.environ for v in USER_VARIABLES) or any(t in os.environ.get("GLIBC_TUNABLES", "")
                                                            for t in USER_TUNABLES):
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


MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # Linux's madvise advice values
HUGE_PAGE = 2 * 2**20
MIN_MAPPING = 8 * 2**20  # smaller mappings are left as they are
_advised: set[tuple[int, int]] = set()  # ranges this process advised already


def large_anonymous_ranges(maps_lines: Iterable[str], min_bytes: int = MIN_MAPPING) -> list[tuple[int, int]]:
    """The whole 2 MiB pages inside each writable anonymous mapping (no file, not the heap or stack)
    of at least `min_bytes`, from /proc/<pid>/maps lines: (start, end) addresses."""
    ranges = []
    for line in maps_lines:
        fields = line.split()
        if len(fields) != 5 or not fields[1].startswith("rw"):  # a sixth field names a file or [heap]
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        start, end = -(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE
        if hi - lo >= min_bytes and end > start:
            ranges.append((start, end))
    return ranges


def _madvise():
    """libc's `madvise` with its argument types, or None off Linux / glibc-compatible C libraries."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def collapse(start: int, end: int) -> bool:
    """Advise [start, end) (whole 2 MiB pages) to huge pages and collapse it now; whether the kernel
    did (it refuses without `MADV_COLLAPSE`, where THP is `never`, or with no free 2 MiB pages)."""
    madvise = _madvise()
    if madvise is None:
        return False
    return madvise(start, end - start, MADV_HUGEPAGE) == 0 and madvise(start, end - start, MADV_COLLAPSE) == 0


def huge_page_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a process whose malloc puts its memory on huge pages as it maps it: glibc's
    `hugetlb` tunable added to GLIBC_TUNABLES, unless that sets `glibc.malloc.hugetlb` already."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:
        return env
    return env | {"GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGE_TUNABLE}" if tunables else HUGE_PAGE_TUNABLE}


def malloc_advises_huge_pages() -> bool:
    """Whether this process started with glibc's `hugetlb=1` tunable (`huge_page_env`)."""
    return HUGE_PAGE_TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")


def back_with_huge_pages(maps: Path = Path("/proc/self/maps")) -> int:
    """`collapse` this process's large anonymous mappings, each range once per process; the bytes
    collapsed. 0 off Linux, where the kernel refuses (errors are not raised), or where malloc
    advises its mappings itself (`malloc_advises_huge_pages`: they are on huge pages already)."""
    if malloc_advises_huge_pages():
        return 0
    try:
        text = maps.read_text()
    except OSError:
        return 0
    collapsed = 0
    for start, end in large_anonymous_ranges(text.splitlines()):
        if (start, end) in _advised:
            continue
        _advised.add((start, end))
        if collapse(start, end):
            collapsed += end - start
    if collapsed:
        log.info("host memory: %d MiB of weights and programs on 2 MiB pages", collapsed >> 20)
    return collapsed
