"""bench/gpu/train.py walks regenerate -> dump -> train on CPU with a tiny target, and a dump or a
training stopped by its time limit goes on where it stopped when run again."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specserve.training.features import DumpConfig, FeatureStore, dump
from specserve.training.train_drafter import TrainConfig, train

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "train.py"
CONVERSATIONS = [
    {"id": str(i), "conversations": [{"from": "human", "value": f"Tell me about the number {i}."},
                                     {"from": "gpt", "value": f"{i} is a number. " * 4}]}
    for i in range(12)
]


def test_the_pipeline_runs_every_stage_once(tmp_path, tiny_target_dir, data_file):
    spec = importlib.util.spec_from_file_location("gpu_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--out", str(tmp_path), "--model-dir", str(tiny_target_dir), "--device", "cpu", "--data", str(data_file),
            "--num-conversations", "12", "--max-new-tokens", "8", "--batch-size", "4", "--regenerate-minutes", "1",
            "--train-minutes", "0.2", "--epochs", "1", "--holdout", "2", "--algorithms", "eagle,mtp"]
    assert module.main(argv) == 0
    log = json.loads((tmp_path / "pipeline.json").read_text())
    assert [e["stage"] for e in log] == ["regenerate", "dump", "train-eagle", "train-mtp"] and all(e["done"] for e in log)
    for algorithm in ("eagle", "mtp"):
        assert (tmp_path / algorithm / "model.safetensors").is_file() and (tmp_path / algorithm / "agreement.csv").is_file()
    assert module.main(argv) == 0  # everything done: nothing runs again
    assert len(json.loads((tmp_path / "pipeline.json").read_text())) == len(log)


def test_a_dump_stopped_by_its_time_limit_goes_on(tmp_path, tiny_target_dir, data_file):
    kw = dict(model_dir=str(tiny_target_dir), out_dir=str(tmp_path), data=str(data_file), num_conversations=12,
              max_len=128, shard_size=4, dtype="float32")
    dump(DumpConfig(**kw, max_minutes=1e-6))  # stops after its first shard
    assert json.loads((tmp_path / "index.json").read_text())["complete"] is False
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == ["shard-00000.safetensors"]
    with pytest.raises(ValueError, match="not complete"):
        FeatureStore(tmp_path)
    dump(DumpConfig(**kw))
    assert json.loads((tmp_path / "index.json").read_text())["complete"] is True and len(FeatureStore(tmp_path).samples) == 12


def test_a_paused_training_goes_on_to_the_same_end(tmp_path, tiny_target_dir, data_file):
    kw = dict(algorithm="eagle", model_dir=str(tiny_target_dir), data=str(data_file), num_conversations=12, max_len=128,
              batch_size=4, draft_vocab_size=16, dtype="float32")
    calls = 0
    while not (tmp_path / "paused" / "train.json").is_file():
        train(TrainConfig(out_dir=str(tmp_path / "paused"), pause_after_minutes=1e-6, **kw))  # one step per call
        calls += 1
        assert calls <= 3
    assert calls == 3 and json.loads((tmp_path / "paused" / "train.json").read_text())["steps"] == 3
    whole = train(TrainConfig(out_dir=str(tmp_path / "whole"), **kw))
    a, b = load_file(tmp_path / "paused" / "model.safetensors"), load_file(whole / "model.safetensors")
    assert all(torch.allclose(a[k], b[k]) for k in a)
