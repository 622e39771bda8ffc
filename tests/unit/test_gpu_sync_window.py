"""The GPU test of structured outputs' host syncs (tests/gpu/test_gpu_path.py: a grammar adds no
synchronising call while the forward runs) rehearsed on the CPU, where CUDA's sync debug mode is
not there: its window opens at every verify step's forward launch and closes at the step's read, it
counts what is reported inside, and the grammar's masks take the GPU's path (built per node before
the read, not lazily along the accepted path). A GPU run can then fail only on what the GPU adds."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.engine import Engine
from specserve.engine.verification import Verifier
from specserve.grammar import GrammarSpec

pytest.importorskip("xgrammar")

GPU_TESTS = Path(__file__).resolve().parents[1] / "gpu" / "test_gpu_path.py"


def gpu_tests():
    spec = importlib.util.spec_from_file_location("gpu_path_tests", GPU_TESTS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROMPTS = [[int(t) for t in torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(n))] * 3
           for n in (4, 7)]


@pytest.mark.parametrize("algorithm", ["none", "ngram"])
def test_the_window_counts_a_sync_inside_each_verify_step(tiny_target_dir, monkeypatch, algorithm):
    gpu = gpu_tests()
    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(Verifier, "_masks_lazily", staticmethod(lambda req, device: False))  # the GPU's masks
    monkeypatch.setattr(Verifier, "_verifies_on_host", staticmethod(lambda reqs, device: False))  # and its read
    verify = Verifier.verify

    def verify_reading_the_device(self, reqs, batch, logits, trees=None):
        if any(r.grammar is not None for r in reqs):  # what a host read of device data reports on a GPU
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=2)
        return verify(self, reqs, batch, logits, trees)

    monkeypatch.setattr(Verifier, "verify", verify_reading_the_device)
    read = Verifier.__dict__["_read"]
    engine = Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", cpu_compile=False,
                                 max_batch_size=2, max_seq_len=256, spec=SpecConfig(algorithm=algorithm)))
    steps = engine.profile.steps
    plain = gpu.syncs_while_the_forward_runs(engine, PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    assert plain == [0] * (engine.profile.steps - steps) and plain
    schema = GrammarSpec("json_schema", json.dumps(gpu.SCHEMA))
    steps = engine.profile.steps
    structured = gpu.syncs_while_the_forward_runs(engine, PROMPTS, SamplingParams(max_tokens=12,
                                                                                  structured_output=schema))
    assert structured == [1] * (engine.profile.steps - steps) and structured
    assert engine.verifier.grammar_nodes > 0
    window = ["warn", "default"]  # opened at a launch, closed at the read; once more at the end of a run
    assert modes == window * len(plain) + ["default"] + window * len(structured) + ["default"]
    assert "step" not in vars(engine.runner) and Verifier.__dict__["_read"] is read  # the patches undone
