"""A check that a function can be captured in a CUDA graph, and a count of the kernels it launches.

`CaptureGuard` is a `TorchDispatchMode`: it sees every aten op a function issues, with its
operands, and raises `CaptureUnsafe` on what breaks a capture or a replay:

- a host read of a device value (`.item()`, `.tolist()`, `bool(t)`: `aten._local_scalar_dense`),
  an op whose output shape depends on values (`nonzero`, `unique`, boolean-mask indexing);
- a host tensor among a device op's operands (a hidden host-to-device copy, or a host value baked
  into the graph), and copies between host and device;
- an op autograd would record (a parameter that requires grad, outside inference mode).

On a machine without a GPU, the engine built on the "meta" device (shapes only, no data) runs
the GPU code path: the runtime's captured functions under the guard with device type "meta"
catch the same faults (a host tensor is still on "cpu"; a scalar written through a device index
is still a 0-dim value of `index_put_`; a number written by indexing, `t[:, 0] = 1`, which CUDA
turns into a host tensor that `fill_` reads, shows on "meta" as `scalar_tensor`). On a GPU the
runtime runs each function once under the guard before capturing it.

`op_count` counts the ops that launch a kernel (views are free): on a GPU each costs about 1-3 us
even when tiny, so the count of one decode step is its launch cost before any GPU is at hand.

This module does not capture anything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

T = TypeVar("T")

_HOST_READS = {"_local_scalar_dense", "nonzero", "unique", "_unique2", "unique_consecutive", "masked_select",
               "repeat_interleave_self_Tensor"}
_FREE = {"detach", "alias", "lift_fresh", "_to_copy_meta"}  # no kernel: metadata only


class CaptureUnsafe(RuntimeError):
    """An op that a CUDA graph cannot capture, or would replay wrongly."""


class CaptureGuard(TorchDispatchMode):
    """Raises `CaptureUnsafe` on the first capture-unsafe op; counts kernel-launching ops by name."""

    def __init__(self, device_type: str = "cuda") -> None:
        super().__init__()
        self.device_type = device_type
        self.ops: Counter[str] = Counter()

    @property
    def op_count(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors}
        if name in _HOST_READS or func.__name__ in _HOST_READS:
            raise CaptureUnsafe(f"{func}: reads a device value on the host (a sync; a graph replays a constant)")
        if self.device_type in devices and "cpu" in devices:
            host = [tuple(t.shape) for t in tensors if t.device.type == "cpu"]
            raise CaptureUnsafe(f"{func}: host tensor(s) of shape {host} among device operands (a hidden copy)")
        target = kwargs.get("device")
        if name == "scalar_tensor" and self.device_type == "meta":  # what CUDA makes a host tensor
            raise CaptureUnsafe(f"{func}: a number written into a tensor by indexing (`t[:, 0] = 1`, `t[i] = True`): "
                                "under CUDA its value is a host tensor; use `fill_`, `masked_fill_` or a device op")
        if name in ("index_put_", "index_put") and args[2].dim() == 0:
            raise CaptureUnsafe(f"{func}: a scalar written through a tensor index (`t[index] = True`): under CUDA "
                                "its value is copied from the host; build the value with a device op")
        if target is not None and devices and torch.device(target).type not in devices:
            raise CaptureUnsafe(f"{func}: copies between host and device")
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            raise CaptureUnsafe(f"{func}: autograd records this op (freeze the weights, run under inference mode)")
        out = func(*args, **kwargs)
        if func.namespace in ("aten", "specserve") and not func.is_view and name not in _FREE:
            self.ops[name] += 1
        return out


def check_capturable(fn: Callable[[], T], device_type: str = "cuda") -> tuple[T, CaptureGuard]:
    """Run `fn` once under a `CaptureGuard` for tensors on `device_type`; returns its output and
    the guard (its op counts). Raises `CaptureUnsafe` naming the first unsafe op."""
    guard = CaptureGuard(device_type)
    with guard:
        out = fn()
    return out, guard
