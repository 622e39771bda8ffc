"""Host-to-device copies of a step go through the pinned staging ring (`specserve.staging`).

A pageable copy makes the host wait for the device at every step. Whole engine steps on the "meta"
device (the GPU path without a GPU; stand-ins for the step's one host read of device values and for
the KV compaction kernel, whose CPU reference reads the host by design), every
algorithm, greedy and sampled rows with penalties, run under a dispatch mode that fails on any
copy from host memory other than the ring; a copy put back as `torch.tensor(..., device=...)`
fails it.
"""

from __future__ import annotations

import pytest
import torch
from test_capture_guard import SPECS, drafter_dirs  # noqa: F401 - the drafters' fixture
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import specserve.staging as staging
import specserve_kernels as K
from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.engine import Engine
from specserve.staging import ring_storage, to_device

META = torch.device("meta")


class HostCopies(TorchDispatchMode):
    """Records every op that reads host memory into a device op, except reads of the ring, and every
    `torch.tensor` / `torch.as_tensor` built on the device from host data (a copy no dispatch mode sees)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.ring = ring_storage(META).data_ptr()
        self.pageable: list[str] = []
        for name in ("tensor", "as_tensor"):
            build = getattr(torch, name)

            def built_on_device(data, *args, _build=build, _name=name, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
                device = kwargs.get("device")
                if device is not None and torch.device(device).type != "cpu":
                    self.pageable.append(f"torch.{_name}(..., device={device})")
                return _build(data, *args, **kwargs)

            monkeypatch.setattr(torch, name, built_on_device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host = [t for t in tensors if t.device.type == "cpu"]
        target = kwargs.get("device")
        to_device = (any(t.device.type == "meta" for t in tensors)
                     or (target is not None and torch.device(target).type == "meta"))
        if host and to_device and any(t.untyped_storage().data_ptr() != self.ring for t in host):
            self.pageable.append(f"{func}: host {[tuple(t.shape) for t in host]}")
        return func(*args, **kwargs)


def test_values_are_staged_in_the_ring_and_copied_from_it():
    before = staging._ring(META).offset
    out = to_device([[1, 2, 3], [4, 5, 6]], META)
    assert (out.device, out.shape, out.dtype) == (META, (2, 3), torch.int64)
    ring = staging._ring(META)
    written = ring.host[ring.offset - 64 : ring.offset - 64 + 48].view(torch.int64)
    assert ring.offset == before + 64 and written.tolist() == [1, 2, 3, 4, 5, 6]  # one 64-byte-aligned piece
    coins = to_device(torch.rand(2, 5), META)
    assert coins.dtype == torch.float32 and coins.shape == (2, 5)
    host = to_device([7, 8], "cpu")
    assert host.device.type == "cpu" and host.tolist() == [7, 8]  # nothing to copy on a CPU


def test_the_ring_starts_over_when_full(monkeypatch):
    monkeypatch.setattr(staging, "RING_BYTES", 256)
    ring = staging._Ring(META)
    pieces = [ring.take(100).data_ptr() - ring.host.data_ptr() for _ in range(3)]
    assert pieces == [0, 128, 0]
    with pytest.raises(ValueError, match="exceed"):
        ring.take(257)


def _steps(engine: Engine, monkeypatch: pytest.MonkeyPatch, sampled: bool) -> HostCopies:
    """Admit, prefill and decode two requests under `HostCopies`; every request accepts its root
    alone (the step's host read, which a meta tensor cannot give, answers so)."""

    def read(rows: torch.Tensor) -> list[list[int]]:
        n = (rows.shape[1] - 3) // 2
        return [[0] * n + [0] + [-1] * (n - 1) + [1, 7, n] for _ in range(rows.shape[0])]

    monkeypatch.setattr(engine.verifier, "_read", read)
    # on a GPU the Triton kernel compacts the KV; its CPU reference reads lengths on the host by design
    monkeypatch.setattr(K, "compact_kv", lambda *args: None)
    params = [SamplingParams(max_tokens=6, ignore_eos=True)]
    params.append(SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, top_p=0.9, seed=1,
                                 repetition_penalty=1.1, frequency_penalty=0.5) if sampled else params[0])
    for prompt, p in zip(([5, 6, 7, 8, 5, 6, 7], [9, 10, 11]), params):
        engine.add_request(prompt, p)
    copies = HostCopies(monkeypatch)
    with copies:
        for _ in range(4):
            engine.step()
    monkeypatch.undo()
    assert len(engine.running) == 2 and all(r.num_verify_steps == 3 for r in engine.running)
    return copies


def _meta_engine(model_dir, algorithm: str, drafter=None, **engine) -> Engine:
    spec = SpecConfig(algorithm=algorithm, drafter_path=str(drafter) if drafter else "", **SPECS[algorithm])
    return Engine(EngineConfig(model_dir=str(model_dir), device="meta", dtype="bfloat16", max_batch_size=4,
                               max_seq_len=128, graph_mode="static", attention_backend="triton", spec=spec, **engine))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("algorithm", ["none", "ngram", "eagle", "eagle3", "mtp"])
def test_an_engine_step_makes_no_pageable_host_to_device_copy(tiny_target_dir, drafter_dirs, monkeypatch,  # noqa: F811
                                                              algorithm, sampled):
    model_dir, drafter = drafter_dirs.get(algorithm, (tiny_target_dir, None))
    copies = _steps(_meta_engine(model_dir, algorithm, drafter), monkeypatch, sampled)
    assert copies.pageable == []


def _reuse_steps(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, int], HostCopies]:
    """Prompts prefilled 4 tokens a step beside a decoding request, a second turn that takes its
    finished slot as it is, and a prompt whose prefix is copied from a running request's slot;
    each request's num_cached_tokens, and the copies seen."""
    monkeypatch.setattr(engine.verifier, "_read", lambda rows: [[0] * ((rows.shape[1] - 3) // 2) + [0]
                                                       + [-1] * ((rows.shape[1] - 3) // 2 - 1)
                                                       + [1, 7, (rows.shape[1] - 3) // 2]] * rows.shape[0])
    monkeypatch.setattr(K, "compact_kv", lambda *args: None)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = [5, 6, 7, 8, 5, 6, 7, 9, 10]
    copies = HostCopies(monkeypatch)
    cached = {}
    with copies:
        engine.add_request(first, params, request_id="first")
        engine.add_request([11, 12], SamplingParams(max_tokens=12, ignore_eos=True), request_id="decoding")
        while "first" not in cached:  # 3 prefill steps, then 2 decoding
            cached |= {out.request_id: out.num_cached_tokens for out in engine.step() if out.finished}
        engine.add_request(first + [7, 7, 7, 13], params, request_id="second")  # every generated token is 7
        engine.step()
        engine.add_request(first[:6] + [14, 15], params, request_id="shares")
        while engine.has_work():
            cached |= {out.request_id: out.num_cached_tokens for out in engine.step() if out.finished}
    monkeypatch.undo()
    assert cached == {"first": 0, "decoding": 0, "second": len(first) + 2, "shares": 6}
    return cached, copies


@pytest.mark.parametrize("algorithm", ["none", "ngram", "eagle", "eagle3", "mtp"])
def test_prefix_reuse_and_chunked_prefill_make_no_pageable_copy(tiny_target_dir, drafter_dirs, monkeypatch,  # noqa: F811
                                                                algorithm):
    """The target's rows and the drafter's state copied between slots, prompts in chunks."""
    model_dir, drafter = drafter_dirs.get(algorithm, (tiny_target_dir, None))
    _, copies = _reuse_steps(_meta_engine(model_dir, algorithm, drafter, max_num_batched_tokens=4), monkeypatch)
    assert copies.pageable == []


def test_a_pageable_copy_put_back_in_the_prefill_fails(tiny_target_dir, monkeypatch):
    import specserve.runtime.prefill as prefill

    monkeypatch.setattr(prefill, "to_device", lambda values, device, dtype=torch.int64: torch.tensor(
        values, dtype=dtype, device=device))
    _, copies = _reuse_steps(_meta_engine(tiny_target_dir, "none", max_num_batched_tokens=4), monkeypatch)
    assert copies.pageable


def test_a_pageable_copy_put_back_fails(tiny_target_dir, monkeypatch):
    import specserve.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "to_device", lambda values, device, dtype=torch.int64: torch.tensor(
        values, dtype=dtype, device=device) if not isinstance(values, torch.Tensor) else values.to(device))
    copies = _steps(_meta_engine(tiny_target_dir, "none"), monkeypatch, sampled=False)
    assert copies.pageable


class DeviceOps(TorchDispatchMode):
    """Counts the ops that would launch work on the device (views and host-only ops left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        target = kwargs.get("device")
        on_device = any(t.device.type == "meta" for t in tensors) or (
            target is not None and torch.device(target).type == "meta")
        if on_device and not func.is_view and func.__name__.split(".")[0] not in ("detach", "alias", "lift_fresh"):
            self.ops.append(func.__name__.split(".")[0])
        return func(*args, **kwargs)


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_a_plain_step_stores_a_heads_features_in_two_device_ops(drafter_dirs, algorithm):  # noqa: F811
    """An adaptive head's plain step (nothing drafted, every row accepts its root) copies its rows'
    positions in and writes their features: two ops. Its general path (a zeros, a copy a row, a
    gather, an arange, an add) cost 0.37 ms of host time a step on an H200."""
    from types import SimpleNamespace

    from specserve.models.llama import ForwardOutput

    model_dir, drafter_path = drafter_dirs[algorithm]
    engine = Engine(EngineConfig(model_dir=str(model_dir), device="meta", dtype="bfloat16", max_batch_size=4,
                                 max_seq_len=128, graph_mode="static", attention_backend="triton",
                                 spec=SpecConfig(algorithm=algorithm, drafter_path=str(drafter_path),
                                                 **SPECS[algorithm])))
    head = engine.drafter
    b, h = 3, engine.model.cfg.hidden_size
    seqs = [SimpleNamespace(slot=i, cache_len=10 + i) for i in range(b)]
    out = ForwardOutput(logits=torch.empty(b, 1, 8, device=META), hidden=torch.empty(b, 1, h, device=META),
                        aux_hidden=torch.empty(b, 1, head.features.shape[-1], device=META))
    roots = [torch.zeros(1, dtype=torch.int64, device=META)] * b
    with DeviceOps() as counted:
        head.on_accept(seqs, out, roots)
    assert counted.ops == ["_to_copy", "index_put_"], counted.ops
    with DeviceOps() as counted:  # a drafted step takes the general path
        head.on_accept(seqs, out, [torch.zeros(2, dtype=torch.int64, device=META)] * b)
    assert len(counted.ops) > 2
