"""Helpers shared by the launchers: input checks and the Triton-or-reference choice.

Nothing here knows about trees or sampling; each op file owns its kernel, launcher and reference.
"""

from __future__ import annotations

import os

import torch

FORCE_TRITON_ENV = "SPECSERVE_FORCE_TRITON"
MAX_NODES = 64  # nodes per tree (root included); the kernels keep a tree's rows in registers


def use_triton(t: torch.Tensor) -> bool:
    """CUDA tensors go to the Triton kernel, CPU tensors to the reference.

    `SPECSERVE_FORCE_TRITON=1` launches the kernel on CPU tensors too; that only works under the
    Triton interpreter (`TRITON_INTERPRET=1`), which is how the kernels are tested without a GPU.
    """
    return t.is_cuda or os.environ.get(FORCE_TRITON_ENV) == "1"


def interpreting() -> bool:
    """Whether Triton kernels run under its interpreter (`TRITON_INTERPRET=1`), not compiled."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_tensor(name: str, t: object, dtype: torch.dtype | None, ndim: int) -> torch.Tensor:
    """Raise ValueError naming `name` unless `t` is a tensor of `dtype` (any float if None) and `ndim` dims."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is None:
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    elif t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    return t


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """Raise ValueError naming the first tensor that is not on the first one's device."""
    items = list(tensors.items())
    device = items[0][1].device
    for name, t in items[1:]:
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, but {items[0][0]} is on {device}")
    return device


def check_num_nodes(name: str, n: int) -> None:
    if not 1 <= n <= MAX_NODES:
        raise ValueError(f"{name}: need 1 <= N <= {MAX_NODES} nodes per tree, got N = {n}")
