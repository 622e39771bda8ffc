"""regenerate-data on a tiny target: the prompts it keeps, the file it writes, and that the answers
are the engine's own greedy outputs."""

from __future__ import annotations

import json

import pytest

from specserve.config import EngineConfig, SamplingParams
from specserve.engine.engine import Engine
from specserve.prompts import render_chat
from specserve.training.data import load_conversations
from specserve.training.regenerate import RegenerateConfig, first_turns, regenerate

CONVERSATIONS = [
    {"id": "0", "conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}]},
    {"id": "1", "conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "Count to three."},
                                  {"from": "gpt", "value": "1 2 3"}]},
    {"id": "2", "conversations": [{"from": "human", "value": "word " * 400}, {"from": "gpt", "value": "ok"}]},
]


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(CONVERSATIONS))
    return path


def test_first_turns_are_the_users_first_messages(data_file):
    assert sorted(first_turns(data_file, 10, seed=0)) == sorted(["Name a colour.", "Count to three.", "word " * 400])


def test_regenerate_writes_the_targets_greedy_answers(tmp_path, tiny_target_dir, data_file):
    out = regenerate(RegenerateConfig(model_dir=str(tiny_target_dir), out=str(tmp_path / "regen.json"),
                                      data=str(data_file), num_conversations=10, max_prompt_tokens=64,
                                      max_new_tokens=6, batch_size=2, save_every=1))
    rows = json.loads(out.read_text())
    by_prompt = {r["conversations"][0]["value"]: r["conversations"][1]["value"] for r in rows}
    assert set(by_prompt) <= {"Name a colour.", "Count to three."}  # the 400-word prompt does not fit in 64
    engine = Engine(EngineConfig(model_dir=str(tiny_target_dir), max_batch_size=1, max_seq_len=128))
    for prompt, answer in by_prompt.items():
        ids = engine.tokenizer.encode(render_chat(str(tiny_target_dir), prompt), add_special_tokens=False).ids
        out_ids = engine.generate([ids], SamplingParams(max_tokens=6))[0].token_ids
        assert answer == engine.tokenizer.decode(out_ids, skip_special_tokens=True).strip()
    # the file is what train-drafter reads
    assert len(load_conversations(out, 10, seed=0)) == len(rows)


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="batch_size"):
        RegenerateConfig(model_dir="m", out="o", batch_size=0)
