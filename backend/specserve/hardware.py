"""What this machine's CPU can do, read once at start-up (Linux `/proc/cpuinfo`).

The engine and `specserve bench` record it beside every figure: bf16 arithmetic is native only
with AVX512-BF16 or AMX; elsewhere it is emulated and float32 may be faster. `auto_dtype` makes
that choice for `dtype="auto"`; `auto_load_format` picks the GGUF's blocks or the checkpoint for
`load_format="auto"`. This module measures nothing and changes nothing.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags, or nothing where /proc/cpuinfo is absent."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _cpuinfo(field: str) -> str:
    """The first processor's `field` in /proc/cpuinfo ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.split(":", 1)[0].strip() == field), "")


def cpu_model() -> str:
    return _cpuinfo("model name")


# the flags that choose kernels here, recorded with every figure (two CPUs of one model name can differ)
RECORDED_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_vp2intersect",
                  "amx_tile", "amx_bf16", "amx_int8")


GGUF_KERNEL_FLAGS = frozenset({"avx2", "fma", "f16c"})  # specserve_kernels.gguf_gemm's


def gguf_kernel_runs() -> bool:
    """Whether the GGUF-block matmul can be built and run here: an x86-64 CPU with AVX2, FMA and F16C,
    and g++ (its build may still fail; the engine then falls back to the checkpoint)."""
    import platform
    import shutil

    return (platform.machine() in ("x86_64", "AMD64") and GGUF_KERNEL_FLAGS <= cpu_flags()
            and shutil.which("g++") is not None)


def auto_load_format(model_dir: str, device: str, dtype: str) -> str:
    """`load_format=auto`: gguf where the GGUF-block kernel runs, the model directory (empty: the
    embedded SmolLM2) has model.gguf and the activations may be float32; else safetensors."""
    from specserve.prepare import GGUF_NAME, default_model_dir

    gguf = Path(model_dir or default_model_dir()) / GGUF_NAME
    if device == "cpu" and dtype in ("auto", "float32") and gguf.is_file() and gguf_kernel_runs():
        return "gguf"
    return "safetensors"


def native_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def auto_dtype(device: str) -> str:
    """bfloat16 on CUDA and on CPUs with native bf16, float32 where bf16 would be emulated."""
    return "bfloat16" if device.startswith("cuda") or native_bf16() else "float32"


def describe() -> dict:
    """The machine as the bench JSON records it."""
    import torch

    return {
        "cpu": cpu_model(),
        "cpu_family_model": f"{_cpuinfo('cpu family')}/{_cpuinfo('model')}",  # AMD 25: Zen 3/4, 26: Zen 5
        "flags": sorted(cpu_flags() & set(RECORDED_FLAGS)),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "bf16_flags": sorted(cpu_flags() & set(BF16_FLAGS)),
        "native_bf16": native_bf16(),
        "avx512": "avx512f" in cpu_flags(),
        "avx2_fma": {"avx2", "fma"} <= cpu_flags(),  # what the few-row matmul kernel needs
        "gguf_kernel": gguf_kernel(),
    }


def gguf_kernel() -> str:
    """Which GGUF-block kernel a served `load_format=gguf` runs here: "int-avx512" (the integer layout,
    512-bit VNNI), "float" (the float layout, AVX2) or "none"."""
    if not gguf_kernel_runs():
        return "none"
    from specserve_kernels import gguf_gemm

    return "int-avx512" if gguf_gemm.default_layout(gguf_gemm.Q4_1) == gguf_gemm.INT_LAYOUT else "float"
