"""train-drafter on a tiny target and a tiny ShareGPT-shaped file: data handling, the published
output format, model card, resume."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from specserve.models.eagle_head import load_eagle
from specserve.models.mtp_head import load_mtp
from specserve.models.weights import load_llama
from specserve.training.data import read_json_array, tokenize_conversation
from specserve.training.train_drafter import TrainConfig, train

CONVERSATIONS = [
    {"id": str(i), "conversations": [{"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
                                     {"from": "gpt", "value": f"The answer is {2 * i}. " * 6}]}
    for i in range(6)
]


def test_truncated_json_array_keeps_complete_records():
    text = json.dumps(CONVERSATIONS)
    assert read_json_array(text) == CONVERSATIONS
    assert read_json_array(text[:-40]) == CONVERSATIONS[:-1]


def test_assistant_mask_covers_exactly_the_answers(smollm2_dir):
    from specserve.prompts import hf_tokenizer

    tok = hf_tokenizer(str(smollm2_dir))
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello there friend"}]
    ids, mask = tokenize_conversation(tok, msgs, 512)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "Hello there friend"
    ids, mask = tokenize_conversation(tok, msgs, 5)
    assert len(ids) == 5 and not any(mask)  # truncated before the answer


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "mtp"])
def test_train_writes_a_loadable_published_checkpoint_and_resumes(tmp_path, tiny_target_dir, data_file, algorithm):
    out = tmp_path / algorithm
    kw = dict(algorithm=algorithm, model_dir=str(tiny_target_dir), out_dir=str(out), data=str(data_file),
              num_conversations=6, max_len=64, batch_size=2, draft_vocab_size=8, checkpoint_every=1)
    train(TrainConfig(**kw))
    record = json.loads((out / "train.json").read_text())
    assert record["steps"] == record["planned_steps"] == 3
    assert (out / "README.md").read_text().startswith("# ")
    target = load_llama(tiny_target_dir, torch.float32)
    head = load_mtp(out, target, torch.float32) if algorithm == "mtp" else load_eagle(out, target, torch.float32)
    if algorithm == "eagle3":
        assert head.cfg.draft_vocab_size == 8 and head.cfg.aux_layer_ids == (2, 4, 5)
    else:
        assert torch.load(out / "token_map.pt").numel() == 8
    # a finished run resumes to the same end without training more, also from a checkpoint written
    # before the newer config fields (init_from, epochs) existed
    ckpt = out / "checkpoint.pt"
    state = torch.load(ckpt, weights_only=True)  # tensors and plain values: nothing to unpickle
    state["config"] = {k: v for k, v in state["config"].items() if k not in ("init_from", "epochs")}
    torch.save(state, ckpt)
    train(TrainConfig(**kw))
    assert json.loads((out / "train.json").read_text())["steps"] == 3
    with pytest.raises(ValueError, match="resume"):
        train(TrainConfig(**(kw | {"lr": 1e-2})))
    # a checkpoint is read as tensors and plain values: an object in it is refused, never built
    torch.save(state | {"extra": _Marker(tmp_path / "built")}, ckpt)
    with pytest.raises(pickle.UnpicklingError):
        train(TrainConfig(**kw))
    assert not (tmp_path / "built").exists()


class _Marker:
    """An object whose unpickling would create a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.path,))


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "mtp"])
def test_init_from_goes_on_from_a_saved_drafter_and_keeps_its_vocabulary(tmp_path, tiny_target_dir, data_file,
                                                                         algorithm):
    from safetensors.torch import load_file

    kw = dict(algorithm=algorithm, model_dir=str(tiny_target_dir), data=str(data_file), num_conversations=6, max_len=64,
              batch_size=2, draft_vocab_size=8)
    first = train(TrainConfig(out_dir=str(tmp_path / "first"), **kw))
    # lr 0: the second run must save exactly the weights it started from, over the same draft vocabulary
    second = train(TrainConfig(out_dir=str(tmp_path / "second"), init_from=str(first), lr=0.0, epochs=2,
                               **(kw | {"draft_vocab_size": 4})))
    assert json.loads((second / "train.json").read_text())["planned_steps"] == 6  # 2 epochs of 3 batches
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if algorithm != "eagle3":
        assert torch.equal(torch.load(first / "token_map.pt"), torch.load(second / "token_map.pt"))
    card = (second / "README.md").read_text()
    assert "started from" in card and "kept from the drafter" in card
    other = "eagle3" if algorithm != "eagle3" else "eagle"
    with pytest.raises(ValueError, match="init_from"):
        train(TrainConfig(out_dir=str(tmp_path / "wrong"), init_from=str(first), **(kw | {"algorithm": other})))


def test_benchmark_prompts_stay_out_of_training_data(tmp_path):
    from specserve.prepare import repo_root
    from specserve.prompts import load_questions
    from specserve.training.data import benchmark_prompts, load_conversations

    mtbench = load_questions("mtbench")[3]
    chat = load_questions(str(repo_root() / "bench/chat_heldout.jsonl"))[0]
    rows = CONVERSATIONS + [
        {"id": "m", "conversations": [{"from": "human", "value": "Please:  " + mtbench.upper()},
                                      {"from": "gpt", "value": "ok"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                                      {"from": "human", "value": chat}, {"from": "gpt", "value": "sure"}]},
    ]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(rows))
    kept = load_conversations(path, 100, seed=0)
    assert len(kept) == len(CONVERSATIONS)
    assert not any(p in " ".join(m["content"].lower().split()) for c in kept for m in c for p in benchmark_prompts())
    assert len(load_conversations(path, 100, seed=0, exclude=[])) == len(rows)


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_the_loss_counts_exactly_the_labelled_positions(tiny_target_dir, algorithm):
    """Logits are computed only where the mask has a label; the loss equals the dense masked one."""
    from specserve.models.draft_heads import HEADS
    from specserve.models.llama import rope_table
    from specserve.training.train_drafter import ttt_losses

    target = load_llama(tiny_target_dir, torch.float32)
    draft_ids = torch.arange(16)
    head = HEADS[algorithm].new(target, draft_ids)
    torch.manual_seed(0)
    b, t = 2, 12
    tokens = torch.randint(0, 16, (b, t))
    width = 3 * target.cfg.hidden_size if algorithm == "eagle3" else target.cfg.hidden_size
    feats = torch.randn(b, t, width)
    probs = torch.randn(b, t, 16).softmax(-1)
    mask = torch.rand(b, t) > 0.4
    rope = rope_table(head.cfg.layer_config(), t + 3, torch.float32)
    steps = ttt_losses(head, tokens, feats, probs, mask, 3, rope)
    for i, (hidden, loss, acc, count) in enumerate(steps):
        n = t - 1 - i
        m = mask[:, 1 + i : 1 + i + n].float()
        logp = head.logits(hidden).log_softmax(-1)
        want = -((probs[:, 1 + i : 1 + i + n] * logp).sum(-1) * m).sum() / m.sum().clamp(min=1)
        torch.testing.assert_close(loss, want)
        hits = (logp.argmax(-1) == probs[:, 1 + i : 1 + i + n].argmax(-1)).float()
        torch.testing.assert_close(acc, (hits * m).sum() / m.sum().clamp(min=1))
        assert count == m.sum()
