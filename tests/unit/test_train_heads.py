"""train-drafters rehearsed on CPU with a tiny target: one command trains the EAGLE-3, EAGLE-2 and
MTP heads from a regenerate-data corpus inside its time limit, and writes heads that load, serve
losslessly and come back as tar parts a GPU run can return."""

from __future__ import annotations

import json
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.engine import Engine
from specserve.training.regenerate import RegenerateConfig, export_prompts, regenerate
from specserve.training.train_heads import HeadsConfig, train_drafters

CONVERSATIONS = [
    {"id": str(i), "conversations": [{"from": "human", "value": f"Tell me a fact about the number {i}."},
                                     {"from": "gpt", "value": "ok"}]}
    for i in range(24)
]
MINUTES = 0.5


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, tiny_target_dir, data_file):
    out = tmp_path_factory.mktemp("corpus") / "corpus"
    regenerate(RegenerateConfig(model_dir=str(tiny_target_dir), out=str(out), data=str(data_file),
                                max_prompt_tokens=64, max_new_tokens=24, batch_size=8, dtype="float32"))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_target_dir, corpus_dir):
    work = tmp_path_factory.mktemp("heads")
    tar = work / "corpus.tar"  # as it travels to a GPU machine
    subprocess.run(["tar", "-cf", str(tar), "-C", str(corpus_dir.parent), corpus_dir.name], check=True)
    hc = HeadsConfig(corpus=str(tar), model_dir=str(tiny_target_dir), out_dir=str(work / "out"),
                     archive_dir=str(work / "archives"), minutes=MINUTES, holdout=4, batch_tokens=512, max_rows=8,
                     draft_vocab_size=256, served_repository=None, archive_part_mib=1, dtype="float32")
    t0 = time.time()
    record = train_drafters(hc)
    return hc, record, time.time() - t0


def test_one_command_trains_every_head_inside_its_time_limit(trained):
    hc, record, seconds = trained
    assert seconds < MINUTES * 60  # the whole command: corpus, target, training, evaluation, writing
    assert record["steps"] > 0 and record["token_passes"] > 0
    for algorithm, steps in (("eagle3", 5), ("eagle", 3), ("mtp", 3)):
        head = record["heads"][algorithm]
        assert len(head["heldout_agreement"]) == len(head["initial_heldout_agreement"]) == steps
        # it learned: the held-out rows agree with the target more than a fresh head's do
        assert head["heldout_agreement"][0] > head["initial_heldout_agreement"][0]
    assert json.loads(Path(hc.out_dir, "train-drafters.json").read_text())["heads"].keys() == record["heads"].keys()


def test_the_heads_come_back_as_few_small_tar_parts(trained, tmp_path):
    hc, _, _ = trained
    parts = sorted(Path(hc.archive_dir).iterdir())
    assert len(parts) <= 8 and all(p.stat().st_size <= hc.archive_part_mib * 2**20 for p in parts)
    for algorithm in ("eagle3", "eagle", "mtp"):
        mine = sorted(p for p in parts if p.name.startswith(f"{algorithm}.tar."))
        joined = tmp_path / f"{algorithm}.tar"
        joined.write_bytes(b"".join(p.read_bytes() for p in mine))
        with tarfile.open(joined) as tar:
            tar.extractall(tmp_path / "unpacked", filter="data")
        for name in ("model.safetensors", "config.json", "README.md"):
            assert ((tmp_path / "unpacked" / algorithm / name).read_bytes()
                    == Path(hc.out_dir, algorithm, name).read_bytes())


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle", "mtp"])
def test_trained_heads_serve_losslessly(trained, tiny_target_dir, algorithm):
    hc, _, _ = trained
    path = Path(hc.out_dir, algorithm)
    token_map = str(path / "token_map.pt") if algorithm != "eagle3" else None
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    params = SamplingParams(max_tokens=16)

    def run(spec: SpecConfig) -> list[list[int]]:
        engine = Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", cpu_compile=False,
                                     max_batch_size=2, max_seq_len=128, spec=spec))
        return [o.token_ids for o in engine.generate(prompts, params)]

    spec = SpecConfig(algorithm=algorithm, drafter_path=str(path), token_map=token_map, num_steps=3, topk=2,
                      num_draft_tokens=6, adaptive=False)
    assert run(spec) == run(SpecConfig(algorithm="none"))


def test_from_nothing_the_command_generates_its_corpus_on_the_device_and_returns_it(tmp_path, tiny_target_dir,
                                                                                     data_file):
    """The command as a GPU machine without a corpus runs it: the target's answers to an exported
    prompts file generated first (within its share of the time, until the tokens asked for), then
    the heads trained, evaluated and archived, the grown corpus returned as tar parts beside them."""
    prompts = export_prompts(tmp_path / "prompts.jsonl", str(data_file), 0)
    hc = HeadsConfig(corpus=None, prompts=str(prompts), generate_answer_tokens=120, generate_batch_size=24,
                     model_dir=str(tiny_target_dir), out_dir=str(tmp_path / "out"),
                     archive_dir=str(tmp_path / "archives"),
                     minutes=MINUTES, holdout=4, batch_tokens=512, max_rows=8, draft_vocab_size=256,
                     served_repository=None, archive_part_mib=1, dtype="float32")
    t0 = time.time()
    record = train_drafters(hc)
    assert time.time() - t0 < MINUTES * 60
    generation = record["generation"]
    assert generation["answer_tokens_given"] == 0
    assert generation["answer_tokens_made"] == record["corpus"]["answer_tokens"] >= 120
    assert generation["seconds"] <= hc.generate_share * MINUTES * 60 + 5 and generation["answer_tokens_per_s"] > 0
    assert record["corpus_archived"] and all((Path(hc.out_dir) / a / "model.safetensors").is_file()
                                             for a in record["heads"])
    parts = sorted(p.name for p in Path(hc.archive_dir).iterdir())
    assert len(parts) <= 8 and [p for p in parts if p.startswith("corpus.tar.")] == ["corpus.tar.00"]
    with tarfile.open(Path(hc.archive_dir) / "corpus.tar.00") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    for name in ("tokens.u16", "rows.jsonl", "corpus.json"):
        assert (tmp_path / "unpacked/corpus" / name).read_bytes() == (Path(hc.out_dir) / "corpus" / name).read_bytes()


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="corpus: give one"):
        HeadsConfig(corpus=None, model_dir="m", out_dir="o")
    with pytest.raises(ValueError, match="algorithms"):
        HeadsConfig(corpus="c", model_dir="m", out_dir="o", algorithms=("medusa",))
    with pytest.raises(ValueError, match="minutes"):
        HeadsConfig(corpus="c", model_dir="m", out_dir="o", minutes=0)
