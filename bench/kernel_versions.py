"""Two versions of one of our C++ kernels in one process, for side-by-side timings: each version is built
as the product builds it (`cpp_build.build`, the library's own flags) with its ops registered under an op
namespace of its own (`specserve_a`, `specserve_b`), so both run alternately in one process (on a 2-core VM
the speed of one process differs from the next by 20-50 %).

A version is a git revision of this repository (the file as committed there), `WORKTREE` (the file as it is
now) or the path of a `.cpp` file (a variant kept outside the tree). Used by `gguf_kernel_ab.py` and
`slot_attention_ab.py`; it times nothing itself.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from specserve_kernels import cpp_build

ROOT = Path(__file__).resolve().parent.parent


def source_text(source: str, rev: str) -> str:
    """The kernel file `source` (relative to the repository) at version `rev`."""
    if rev == "WORKTREE":
        return (ROOT / source).read_text()
    if rev.endswith(".cpp"):
        return Path(rev).read_text()
    return subprocess.run(["git", "show", f"{rev}:{source}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def build(library: cpp_build.OpLibrary, stem: str, tag: str, text: str, directory: Path) -> object:
    """Builds `text` with `library`'s flags, its ops registered under `specserve_<tag>`; returns that op
    namespace (`torch.ops.specserve_<tag>`)."""
    text = text.replace("TORCH_LIBRARY_FRAGMENT(specserve, m)", f"TORCH_LIBRARY(specserve_{tag}, m)")
    text = text.replace("TORCH_LIBRARY_IMPL(specserve, CPU, m)", f"TORCH_LIBRARY_IMPL(specserve_{tag}, CPU, m)")
    path = directory / f"{stem}_{tag}.cpp"
    path.write_text(text)
    cpp_build.build(f"{stem}_{tag}", path, directory, extra_cflags=["-O3", *library.cflags, "-fopenmp"],
                    extra_ldflags=["-fopenmp"], is_python_module=False)
    return getattr(torch.ops, f"specserve_{tag}")
