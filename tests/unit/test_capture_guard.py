"""The GPU code path without a GPU: every function the runtime captures as a CUDA graph, run under
the capture guard on an engine built on the "meta" device (shapes only), for every algorithm.

The guard fails on what broke capture on a real GPU (a Python scalar written through a device
index; weights that require grad outside inference mode), on host reads and host operands; the
tests below put each fault back and check that it fails. The same run counts the ops of a decode
step: each is a kernel launch on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import specserve.drafters.beam as beam
from specserve.config import EngineConfig, SpecConfig
from specserve.engine.engine import Engine
from specserve.models.weights import load_llama
from specserve.runtime.capture_guard import CaptureUnsafe, check_capturable

SPECS = {
    "none": dict(),
    "ngram": dict(num_draft_tokens=8),
    "eagle": dict(num_steps=3, topk=2, num_draft_tokens=6),
    "eagle3": dict(num_steps=3, topk=2, num_draft_tokens=6),
    "mtp": dict(num_steps=2, topk=2, num_draft_tokens=4),
    "standalone": dict(num_steps=3, topk=2, num_draft_tokens=6, standalone_num_layers=1),
}


@pytest.fixture(scope="module")
def drafter_dirs(tmp_path_factory, tiny_target_dir):
    from test_eagle import write_checkpoint
    from test_mtp import with_mtp_head

    tmp = tmp_path_factory.mktemp("guard")
    return {"eagle": (tiny_target_dir, write_checkpoint(tmp / "eagle", "eagle")),
            "eagle3": (tiny_target_dir, write_checkpoint(tmp / "eagle3", "eagle3")),
            "mtp": (with_mtp_head(tiny_target_dir, tmp / "mtp", "deepseek"), None)}


def meta_engine(model_dir, algorithm="none", drafter_path=None, attention="triton") -> Engine:
    """An engine on the "meta" device in the static (CUDA-graph) layout: what `graph_mode=auto`
    builds on a GPU, minus the capture."""
    spec = SpecConfig(algorithm=algorithm, drafter_path=str(drafter_path) if drafter_path else "", **SPECS[algorithm])
    return Engine(EngineConfig(model_dir=str(model_dir), device="meta", dtype="bfloat16", max_batch_size=4,
                               max_seq_len=128, graph_mode="static", attention_backend=attention, spec=spec))


def captured_functions(engine: Engine) -> dict:
    fns = {("target", *key): fn for key, fn in engine.runner.graphs.captured_functions().items()}
    drafts = getattr(getattr(engine.drafter, "runner", None), "graphs", None)
    if drafts is not None:
        fns |= {("draft", bs): fn for bs, fn in drafts.captured_functions().items()}
    return fns


@pytest.mark.parametrize("attention", ["torch", "triton"])
@pytest.mark.parametrize("algorithm", list(SPECS))
def test_every_captured_function_is_capture_safe(tiny_target_dir, drafter_dirs, algorithm, attention):
    model_dir, drafter = drafter_dirs.get(algorithm, (tiny_target_dir, None))
    engine = meta_engine(model_dir, algorithm, drafter, attention)
    fns = captured_functions(engine)
    assert any(key[0] == "target" for key in fns)
    assert (algorithm in ("eagle", "eagle3", "mtp", "standalone")) == any(key[0] == "draft" for key in fns)
    for fn in fns.values():
        check_capturable(fn, "meta")


def test_a_scalar_written_through_a_device_index_fails(tiny_target_dir, drafter_dirs, monkeypatch):
    """The fault that failed the EAGLE drafts' capture on a GPU, put back into the beam."""

    def marks_by_index_write(k, first, width, device):
        marks = torch.zeros(k, width, dtype=torch.bool, device=device)
        own = torch.arange(k, device=device)
        marks[own, first + own] = True
        return marks

    engine = meta_engine(*drafter_dirs["eagle3"][:1], "eagle3", drafter_dirs["eagle3"][1])
    draft = engine.drafter.runner.graphs.captured_functions()[1]
    check_capturable(draft, "meta")
    monkeypatch.setattr(beam, "own_entries", marks_by_index_write)
    with pytest.raises(CaptureUnsafe, match="number written into a tensor"):
        check_capturable(draft, "meta")


def test_a_number_assigned_to_a_slice_fails():
    """The fault that failed every head's draft capture on an H200 (`all_parents[:, 1:3] = 0` in the
    beam): under CUDA the number becomes a host tensor that `fill_` reads; on "meta" it shows as
    `scalar_tensor`. The guard names it on both; `fill_` with the number is safe."""
    x = torch.zeros(2, 4, device="meta")

    def assign() -> None:
        x[:, 1:3] = 0

    with pytest.raises(CaptureUnsafe, match="number written into a tensor"):
        check_capturable(assign, "meta")
    check_capturable(lambda: x[:, 1:3].fill_(0), "meta")
    with pytest.raises(CaptureUnsafe, match="host tensor"):  # CUDA's form: fill_ from a host number
        check_capturable(lambda: torch.ops.aten.fill_.Tensor(x[:, 1:3], torch.tensor(0.0)), "meta")


def test_weights_that_require_grad_fail_outside_inference_mode(tiny_target_dir):
    """The fault that failed the target's capture on a GPU: weights left requiring grad and a
    capture outside inference mode. Weights load frozen; the runtime captures under inference mode."""
    assert not any(p.requires_grad for p in load_llama(tiny_target_dir, torch.float32).parameters())
    engine = meta_engine(tiny_target_dir)
    runner = engine.runner.graphs
    bucket = runner.buckets[(1, 1)]
    check_capturable(lambda: runner._run(bucket), "meta")  # frozen weights: safe even outside inference mode
    engine.model.requires_grad_(True)
    with pytest.raises(CaptureUnsafe, match="autograd"):
        check_capturable(lambda: runner._run(bucket), "meta")
    check_capturable(runner.captured_functions()[(1, 1)], "meta")  # what the runtime captures: inference mode


def test_host_reads_and_host_operands_fail():
    x = torch.ones(4, device="meta")
    for fault in (lambda: (x.sum() > 0).item(), lambda: x + torch.ones(4), lambda: x.nonzero(),
                  lambda: torch.ones(4).to("meta")):
        with pytest.raises(CaptureUnsafe):
            check_capturable(fault, "meta")
    _, guard = check_capturable(lambda: (x * 2).view(2, 2).sum(0), "meta")
    assert dict(guard.ops) == {"mul": 1, "sum": 1}  # the view launches nothing


def test_decode_step_kernel_count(tiny_target_dir):
    """Ops (GPU kernels) of one captured decode step of the bf16 target on the GPU path: per layer
    four matmuls, two fused add + norm, RoPE with the cache write, attention, silu * up."""
    engine = meta_engine(tiny_target_dir)
    _, guard = check_capturable(engine.runner.graphs.captured_functions()[(1, 1)], "meta")
    layers = engine.model_config.num_layers
    per_layer = {"linear": 4, "add_rms_norm": 2, "rope_kv_write": 1, "tree_attention": 1, "silu_mul": 1}
    assert {op: guard.ops[op] // layers for op in per_layer} == per_layer, dict(guard.ops)
    assert guard.op_count <= 9 * layers + 10, dict(guard.ops)  # + embedding, first norm, rope gather, lm_head
