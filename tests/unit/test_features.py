"""dump-features and train-drafter --features on a tiny target: the dump's layout, resuming a
stopped dump, and training from the dump giving the losses of online training."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specserve.training.features import DumpConfig, FeatureStore, dump
from specserve.training.train_drafter import TrainConfig, train

CONVERSATIONS = [
    {"id": str(i), "conversations": [{"from": "human", "value": f"Question {i}: what is {i} times {i}?"},
                                     {"from": "gpt", "value": f"It is {i * i}, because {i} x {i}. " * (2 + i % 3)}]}
    for i in range(10)
]


@pytest.fixture(scope="module")
def dumped(tmp_path_factory, tiny_target_dir, data_file):
    out = tmp_path_factory.mktemp("dump")
    dump(DumpConfig(model_dir=str(tiny_target_dir), out_dir=str(out), data=str(data_file), num_conversations=10,
                    max_len=256, batch_size=3, shard_size=4, dtype="float32"))
    return out


def test_dump_holds_every_conversation_in_shards(dumped, tiny_target_dir):
    index = json.loads((dumped / "index.json").read_text())
    assert index["shards"] == ["shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    assert index["conversations"] == 10 and index["aux_layer_ids"] == [2, 4, 5]
    shard = load_file(dumped / "shard-00000.safetensors")
    n = int(shard["offsets"][-1])
    assert shard["tokens"].shape == (n,) and shard["loss_mask"].shape == (n,)
    h = index["hidden_size"]
    assert shard["hidden"].shape == (n, h) and shard["aux"].shape == (n, 3 * h)
    store = FeatureStore(dumped)
    assert len(store.samples) == 10 and index["tokens"] == sum(len(ids) for ids, _ in store.samples)
    lengths = [len(ids) for ids, _ in store.samples]
    short, long = lengths.index(min(lengths)), lengths.index(max(lengths))
    assert min(lengths) < max(lengths)
    hidden, aux = store.features([short, long], max(lengths), aux=True)
    assert hidden.shape == (2, max(lengths), h) and aux.shape == (2, max(lengths), 3 * h)
    assert hidden[0, : min(lengths)].abs().sum(-1).min() > 0 and not hidden[0, min(lengths) :].any()  # zero padding


def test_a_stopped_dump_goes_on_from_its_last_complete_shard(tmp_path, dumped, tiny_target_dir, data_file):
    kw = dict(model_dir=str(tiny_target_dir), out_dir=str(tmp_path), data=str(data_file), num_conversations=10,
              max_len=256, batch_size=3, shard_size=4, dtype="float32")
    for name in ("index.json", "shard-00000.safetensors"):
        (tmp_path / name).write_bytes((dumped / name).read_bytes())
    before = (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns
    dump(DumpConfig(**kw))
    assert (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns == before  # kept, not recomputed
    index = json.loads((tmp_path / "index.json").read_text())
    assert (index["tokens_this_run"]
            == index["tokens"] - int(load_file(dumped / "shard-00000.safetensors")["offsets"][-1]))
    for name in ("shard-00001.safetensors", "shard-00002.safetensors"):
        a, b = load_file(dumped / name), load_file(tmp_path / name)
        assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="resume"):
        dump(DumpConfig(**(kw | {"max_len": 128})))


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "mtp"])
def test_training_from_the_dump_gives_the_losses_of_online_training(tmp_path, dumped, tiny_target_dir, data_file,
                                                                     algorithm):
    kw = dict(algorithm=algorithm, model_dir=str(tiny_target_dir), batch_size=3, draft_vocab_size=16, epochs=2,
              dtype="float32", lr=1e-2)
    online = train(TrainConfig(out_dir=str(tmp_path / "online"), data=str(data_file), num_conversations=10, max_len=256,
                               **kw))
    stored = train(TrainConfig(out_dir=str(tmp_path / "stored"), features=str(dumped), **kw))
    a, b = (json.loads((d / "train.json").read_text()) for d in (online, stored))
    assert a["steps"] == b["steps"] == 8 and a["tokens_seen"] == b["tokens_seen"]
    assert [h["loss"] for h in a["history"]] == pytest.approx([h["loss"] for h in b["history"]], abs=2e-4)
    assert [h["acc"] for h in a["history"]] == [h["acc"] for h in b["history"]]
    wa, wb = load_file(online / "model.safetensors"), load_file(stored / "model.safetensors")
    assert all(torch.allclose(wa[k].float(), wb[k].float(), atol=1e-3) for k in wa)


def test_eagle3_needs_a_dump_with_its_auxiliary_inputs(tmp_path, tiny_target_dir, data_file):
    out = dump(DumpConfig(model_dir=str(tiny_target_dir), out_dir=str(tmp_path / "d"), data=str(data_file),
                          num_conversations=4, max_len=256, aux=False, dtype="float32"))
    with pytest.raises(ValueError, match="auxiliary"):
        train(TrainConfig(algorithm="eagle3", model_dir=str(tiny_target_dir), out_dir=str(tmp_path / "t"),
                          features=str(out), draft_vocab_size=16, dtype="float32"))


def test_a_heldout_split_logs_agreement_by_step_and_keeps_the_best_head(tmp_path, dumped, tiny_target_dir):
    out = train(TrainConfig(algorithm="eagle3", model_dir=str(tiny_target_dir), out_dir=str(tmp_path / "t"),
                            features=str(dumped), holdout=3, batch_size=2, epochs=2, checkpoint_every=2,
                            draft_vocab_size=16, dtype="float32", lr=5e-3, ttt_steps=3))
    record = json.loads((out / "train.json").read_text())
    curve = record["agreement_curve"]
    assert record["steps"] == 8 and [c["step"] for c in curve] == [0, 2, 4, 6, 8]  # 7 conversations, batches of 2
    assert all(len(c["agreement"]) == 3 and all(0 <= a <= 1 for a in c["agreement"]) for c in curve)
    best = max(curve, key=lambda c: c["expected_accepted"])
    assert record["best_step"] == best["step"] and record["heldout_agreement"] == best["agreement"]
    rows = (out / "agreement.csv").read_text().splitlines()
    assert rows[0].startswith("step,tokens_seen,minutes,agreement_step1") and len(rows) == 1 + len(curve)
    assert (out / "agreement.png").stat().st_size > 0
    with pytest.raises(ValueError, match="holdout"):
        train(TrainConfig(algorithm="eagle", model_dir=str(tiny_target_dir), out_dir=str(tmp_path / "u"),
                          features=str(dumped), holdout=10, dtype="float32"))


def test_expected_accepted_is_the_chain_product_sum():
    from specserve.training.train_drafter import expected_accepted

    assert expected_accepted([0.5, 0.5]) == pytest.approx(0.75)
    assert expected_accepted([]) == 0.0
