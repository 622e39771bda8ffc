"""`host_memory.back_with_huge_pages`: which mappings it advises, and that a real one ends on 2 MiB
pages where this kernel can collapse them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.host_memory import HUGE_PAGE, back_with_huge_pages, collapse, large_anonymous_ranges

MAPS = """\
7f0000000000-7f0001000000 rw-p 00000000 00:00 0
7f0001000000-7f0001100000 rw-p 00000000 00:00 0
7f0002000000-7f0004000000 r--p 00000000 08:01 123 /model/x.wrapper.so
555500000000-555520000000 rw-p 00000000 00:00 0 [heap]
7f0010100000-7f0011300000 rw-p 00000000 00:00 0
"""


def test_only_large_writable_anonymous_mappings_in_whole_huge_pages():
    ranges = large_anonymous_ranges(MAPS.splitlines(), min_bytes=8 * 2**20)
    # 16 MiB kept whole; 1 MiB too small; the file and the heap left alone; 18 MiB cut to its whole 2 MiB pages
    assert ranges == [(0x7F0000000000, 0x7F0001000000), (0x7F0010200000, 0x7F0011200000)]
    assert all(start % HUGE_PAGE == 0 and end % HUGE_PAGE == 0 for start, end in ranges)


def anon_huge_kib(start: int, end: int) -> int:
    """AnonHugePages (KiB) of the mappings overlapping [start, end) (advice splits a mapping)."""
    inside, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = lo < end and start < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(head[1])
    return total


def test_a_large_tensor_ends_on_huge_pages_where_the_kernel_collapses():
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.is_file() or "[never]" in thp.read_text():
        pytest.skip("no transparent huge pages here")
    weights = torch.ones(64 * 2**20 // 4)  # 64 MiB: a mapping of its own
    lo, hi = weights.data_ptr(), weights.data_ptr() + weights.nbytes
    span = (-(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE)
    if not collapse(*span):
        pytest.skip("the kernel did not collapse: MADV_COLLAPSE needs Linux 6.1+ and free 2 MiB pages")
    assert anon_huge_kib(*span) >= (span[1] - span[0]) >> 10  # every whole 2 MiB page of it (and its neighbours)
    assert torch.equal(weights, torch.ones_like(weights))  # the contents moved with the pages


def test_the_process_pass_advises_each_range_once(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr("specserve.host_memory.collapse", lambda start, end: calls.append((start, end)) or True)
    monkeypatch.setattr("specserve.host_memory._advised", set())
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)  # malloc does not advise huge pages itself
    maps = tmp_path / "maps"
    maps.write_text(MAPS)
    first, second = back_with_huge_pages(maps), back_with_huge_pages(maps)
    assert calls == large_anonymous_ranges(MAPS.splitlines())
    assert first == sum(end - start for start, end in calls) and second == 0
