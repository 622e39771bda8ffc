"""glibc's thresholds fixed by `keep_freed_memory`: buffers a step allocates and frees together
are reused from the heap by the next step instead of mapped and zero-filled anew (counted as the
process's minor page faults, in a fresh interpreter so that no earlier allocation has moved glibc's
thresholds)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from specserve import host_memory

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's allocator only")

CHILD = """
import json, resource, sys
import torch
from specserve.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
size = 8 * 3 * 272 * 64  # a layer's gathered keys at batch 8, 272 cached entries: 1.7 MB
faults = []
for step in range(10):  # per layer: keys and values gathered, joined with the new token's, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    outputs = []
    for layer in range(30):
        k, v = torch.empty(size).fill_(1.0), torch.empty(size).fill_(1.0)
        keys, values = torch.cat([k, k[:64]]), torch.cat([v, v[:64]])
        outputs.append(torch.empty(8 * 576).fill_(0.0))
        del k, v, keys, values
    del outputs
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _child(mode: str, env: dict[str, str] | None = None) -> dict:
    # glibc's defaults, page faults counted in 4 KiB pages
    env = {k: v for k, v in (env or os.environ).items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_step_s_freed_buffers_are_reused_instead_of_mapped_again():
    pages = 4 * 8 * 3 * 272 * 64 * 4 // 4096  # one layer's buffers
    default, kept = _child("default"), _child("keep")
    assert kept["applied"]
    # glibc's default: buffers are mapped, or the heap they came from is trimmed, so that steps
    # fault in (and the kernel zero-fills) pages for several layers' buffers (about 7 a step on
    # glibc 2.36; how many varies with what the process allocated before)
    later = default["faults"][2:]
    assert sum(later) / len(later) > 4 * pages, later
    # fixed thresholds: the first step grows the heap, which keeps the memory for the next ones (in some
    # heap layouts a later step still grows it once by a buffer or so: the mean over the later steps, as above)
    assert kept["faults"][0] > pages
    later = kept["faults"][2:]
    assert sum(later) / len(later) < pages // 4, later


def test_the_environment_s_own_settings_are_left_alone(monkeypatch):
    host_memory.keep_freed_memory.cache_clear()
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    try:
        assert host_memory.keep_freed_memory() is False
    finally:
        host_memory.keep_freed_memory.cache_clear()


def test_a_threshold_tunable_is_the_environment_s_own_and_the_huge_page_one_is_not(monkeypatch):
    for tunables, ours in [("glibc.malloc.trim_threshold=0", False), ("glibc.malloc.hugetlb=1", True)]:
        host_memory.keep_freed_memory.cache_clear()
        monkeypatch.setenv("GLIBC_TUNABLES", tunables)
        try:
            assert host_memory.keep_freed_memory() is ours
        finally:
            host_memory.keep_freed_memory.cache_clear()


def test_child_processes_get_malloc_s_huge_pages_unless_the_environment_chose():
    assert host_memory.huge_page_env({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    mixed = host_memory.huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert mixed["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    chosen = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert host_memory.huge_page_env(chosen) == chosen


def test_a_process_whose_malloc_advises_huge_pages_collapses_nothing(monkeypatch, tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f0000000000-7f0001000000 rw-p 00000000 00:00 0\n")
    calls = []
    monkeypatch.setattr(host_memory, "collapse", lambda start, end: calls.append((start, end)) or True)
    monkeypatch.setattr(host_memory, "_advised", set())
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    assert host_memory.back_with_huge_pages(maps) == 0 and calls == []
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert host_memory.back_with_huge_pages(maps) == 16 * 2**20 and len(calls) == 1


def test_the_command_starts_again_with_malloc_s_huge_pages_once(monkeypatch):
    from specserve import cli

    started = []
    monkeypatch.setattr(cli.os, "execve", lambda path, args, env: started.append((args, env)))
    monkeypatch.setattr(cli.sys, "argv", ["specserve", "bench", "--algorithm", "ngram"])
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    cli._reexec_with_huge_pages()
    [(args, env)] = started
    assert args[1:] == ["-m", "specserve.cli", "bench", "--algorithm", "ngram"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    monkeypatch.setenv("GLIBC_TUNABLES", env["GLIBC_TUNABLES"])  # the new process: nothing to do
    cli._reexec_with_huge_pages()
    assert len(started) == 1
