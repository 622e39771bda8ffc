"""bench/gpu/train.sh, the one GPU training command, runs on CPU with a tiny target and returns its
files; a dump or a training stopped by its time limit goes on where it stopped when run again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specserve.training.features import DumpConfig, FeatureStore, dump
from specserve.training.regenerate import RegenerateConfig, regenerate
from specserve.training.train_drafter import TrainConfig, train

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "train.sh"
CONVERSATIONS = [
    {"id": str(i), "conversations": [{"from": "human", "value": f"Tell me about the number {i}."},
                                     {"from": "gpt", "value": f"{i} is a number. " * 4}]}
    for i in range(12)
]


def test_the_gpu_command_runs_on_cpu_and_returns_its_files(tmp_path, tiny_target_dir, data_file):
    """train.sh with a staged corpus and a prompts file: the corpus grown to the answer tokens asked
    for, the heads trained, everything back in at most 8 files inside the time limit."""
    from specserve.training.regenerate import export_prompts

    corpus = tmp_path / "corpus"
    regenerate(RegenerateConfig(model_dir=str(tiny_target_dir), out=str(corpus), data=str(data_file),
                                num_conversations=4, max_new_tokens=16, batch_size=4, dtype="float32"))
    subprocess.run(["tar", "-cf", str(tmp_path / "corpus.tar"), "-C", str(tmp_path), "corpus"], check=True)
    prompts = export_prompts(tmp_path / "prompts.jsonl", str(data_file), 0)
    env = os.environ | {"DEVICE": "cpu", "MINUTES": "0.6", "ANSWER_TOKENS": "60", "WORK": str(tmp_path / "work"),
                        "PYTHON": sys.executable,
                        "TRAIN_ARGS": f"--model-dir {tiny_target_dir} --holdout 2 --dtype float32"}
    out = tmp_path / "out"
    subprocess.run([str(SCRIPT), str(out), str(tmp_path / "corpus.tar"), str(prompts)], env=env, check=True,
                   timeout=120)
    names = sorted(p.name for p in out.iterdir())
    assert names[-2:] == ["train-drafters.json", "train.log"] and len(names) <= 8
    assert {n.split(".")[0] for n in names[:-2]} == {"eagle3", "eagle", "mtp", "corpus"}
    record = json.loads((out / "train-drafters.json").read_text())
    assert record["minutes"] <= 0.6 and record["corpus"]["answer_tokens"] >= 60
    assert 0 < record["generation"]["answer_tokens_given"] < 60


def test_a_dump_stopped_by_its_time_limit_goes_on(tmp_path, tiny_target_dir, data_file):
    kw = dict(model_dir=str(tiny_target_dir), out_dir=str(tmp_path), data=str(data_file), num_conversations=12,
              max_len=128, shard_size=4, dtype="float32")
    dump(DumpConfig(**kw, max_minutes=1e-6))  # stops after its first shard
    assert json.loads((tmp_path / "index.json").read_text())["complete"] is False
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == ["shard-00000.safetensors"]
    with pytest.raises(ValueError, match="not complete"):
        FeatureStore(tmp_path)
    dump(DumpConfig(**kw))
    assert (json.loads((tmp_path / "index.json").read_text())["complete"] is True
            and len(FeatureStore(tmp_path).samples) == 12)


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
