"""Every Triton kernel through Triton's real compiler for sm_90 and sm_80, without a GPU.

`specserve_kernels.compile_check` runs in a subprocess: the kernel tests' process has
TRITON_INTERPRET=1 set, which turns every kernel into the interpreter's for good.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specserve_kernels.compile_check import missing_support

KERNELS = {
    "_build_tree_kernel", "_verify_greedy_kernel", "_verify_sample_kernel", "_compact_kv_kernel",
    "_tree_attention_split_kernel", "_tree_attention_merge_kernel", "_add_rms_norm_kernel",
    "_rope_kv_write_kernel", "_silu_mul_kernel",
}

pytestmark = pytest.mark.skipif(missing_support() is not None, reason=f"compile check: {missing_support()}")


def _check(tmp_path: Path, *args: str) -> tuple[int, str, dict]:
    """Run the check with `args`; (exit status, its output, its JSON report)."""
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SPECSERVE_FORCE_TRITON")}
    done = subprocess.run([sys.executable, "-m", "specserve_kernels.compile_check", "--json", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text()) if out.exists() else {}
    return done.returncode, done.stdout + done.stderr, report


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The whole launch plan, compiled for sm_90 and sm_80."""
    rc, output, report = _check(tmp_path_factory.mktemp("compile_check"), "--arch", "90,80")
    assert rc == 0, output
    return report


def test_every_kernel_compiles_within_shared_memory_and_without_spills(report):
    assert report["failures"] == []
    for arch in ("90", "80"):
        assert {row["kernel"] for row in report[arch]["variants"]} == KERNELS
        assert all(not row["faults"] for row in report[arch]["variants"])


@pytest.mark.parametrize("launches", [
    r"decode B=8 cache=\d+$",  # one token over a cache growing from 1 to 8 splits
    r"verify T=(16|24|32|64) ",  # trees of 16-64 tokens, any batch and cache, eager or captured
    r"catch-up T=(17|100|129|171|342|1000|1024|2047) ",  # a whole prompt: every T with the same tile
])
@pytest.mark.parametrize("model", ["SmolLM2-135M", "Llama-3.1-8B"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_compiled_kernel_serves_every_cache_length_and_T(report, launches, model, dtype):
    """Launches that differ only in cache length, T or batch, at one tile: each kernel compiles once."""
    selected = [launch for launch in report["90"]["launches"]
                if launch["label"].startswith(f"{model} {dtype} ") and re.search(launches, launch["label"])]
    assert len(selected) >= 6
    keys_per_kernel: dict[str, set[str]] = {}
    for launch in selected:
        for key in launch["keys"]:
            keys_per_kernel.setdefault(key.split("|")[0], set()).add(key)
    assert "_tree_attention_split_kernel" in keys_per_kernel
    assert {kernel: len(keys) for kernel, keys in keys_per_kernel.items()} == dict.fromkeys(keys_per_kernel, 1)


def test_the_check_fails_a_spilling_decode_kernel(tmp_path):
    """The interpreter's float32 dot put back for bfloat16 (as when it was keyed on the device):
    the split kernel of a 16-token verify spills, and the check fails it."""
    rc, output, report = _check(tmp_path, "--arch", "90", "--inject", "interpreter-dot",
                                "--select", "SmolLM2-135M bfloat16 verify T=16 B=8 cache=300")
    assert rc == 1, output
    assert len(report["failures"]) == 1
    assert "_tree_attention_split_kernel" in report["failures"][0] and "register spills" in report["failures"][0]


def test_the_check_fails_a_rope_that_fuses_its_multiply_add(tmp_path):
    """Fusion put back into the RoPE kernel: sm_90 sums its two bf16 products with one fma (found
    on an H200, a bf16 ulp off the eager forward), and the check fails it."""
    rc, output, report = _check(tmp_path, "--arch", "90", "--inject", "rope-fma",
                                "--select", "SmolLM2-135M bfloat16 decode B=1")
    assert rc == 1, output
    assert report["failures"] and all("_rope_kv_write_kernel" in f and "multiply-add" in f for f in report["failures"])
