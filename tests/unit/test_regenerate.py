"""regenerate-data on a tiny target: the prompts it keeps, the file it writes, and that the answers
are the engine's own greedy outputs."""

from __future__ import annotations

import json

import pytest

from specserve.config import EngineConfig, SamplingParams
from specserve.engine.engine import Engine
from specserve.prompts import hf_tokenizer, render_chat
from specserve.training.data import load_conversations, tokenize_conversation
from specserve.training.regenerate import RegenerateConfig, first_turns, loop_cut, regenerate

CONVERSATIONS = [
    {"id": "0", "conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}]},
    {"id": "1", "conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "Count to three."},
                                  {"from": "gpt", "value": "1 2 3"}]},
    {"id": "2", "conversations": [{"from": "human", "value": "word " * 400}, {"from": "gpt", "value": "ok"}]},
]


def test_first_turns_are_the_users_first_messages(data_file):
    assert sorted(first_turns(data_file, 10, seed=0)) == sorted(["Name a colour.", "Count to three.", "word " * 400])


def test_regenerate_writes_the_targets_greedy_answers(tmp_path, tiny_target_dir, data_file):
    out = regenerate(RegenerateConfig(model_dir=str(tiny_target_dir), out=str(tmp_path / "regen.json"),
                                      data=str(data_file), num_conversations=10, max_prompt_tokens=64,
                                      max_new_tokens=6, batch_size=2, save_every=1))
    rows = json.loads(out.read_text())
    by_prompt = {r["conversations"][0]["value"]: r["conversations"][1] for r in rows}
    assert set(by_prompt) <= {"Name a colour.", "Count to three."}  # the 400-word prompt does not fit in 64
    engine = Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="bfloat16", cpu_compile=False,
                                 max_batch_size=1, max_seq_len=128))
    tok = hf_tokenizer(str(tiny_target_dir))
    for prompt, answer in by_prompt.items():
        ids = engine.tokenizer.encode(render_chat(str(tiny_target_dir), prompt), add_special_tokens=False).ids
        out_ids = engine.generate([ids], SamplingParams(max_tokens=6))[0].token_ids
        cut = loop_cut(out_ids[:-1]) is not None or loop_cut(out_ids) is not None
        assert answer["ids"] == out_ids or (cut and out_ids[: len(answer["ids"])] == answer["ids"])
        assert answer["value"] == engine.tokenizer.decode(answer["ids"], skip_special_tokens=True).strip()
        # training reads the target's own ids after the prompt as served
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer["value"],
                                                      "ids": answer["ids"]}]
        train_ids, mask = tokenize_conversation(tok, msgs, 512)
        assert train_ids == ids + answer["ids"] and mask == [False] * len(ids) + [True] * len(answer["ids"])
    # the file is what train-drafter reads, ids included
    convs = load_conversations(out, 10, seed=0)
    assert len(convs) == len(rows) and all("ids" in c[1] for c in convs)


def test_a_looping_answer_is_cut_at_the_second_repeat():
    loop = [5, 6, 7, 8, 9]
    assert loop_cut([1, 2, 3] + loop * 3) == 3 + 2 * len(loop)
    assert loop_cut([1, 2, 3] + loop * 2) is None
    assert loop_cut([4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]) == 8  # the shortest window that repeats
    assert loop_cut(list(range(100))) is None


def test_repeated_prompts_are_drawn_once(tmp_path):
    path = tmp_path / "dups.json"
    path.write_text(json.dumps(CONVERSATIONS + [{"id": "3", "conversations": [
        {"from": "human", "value": "name a   COLOUR."}, {"from": "gpt", "value": "Red."}]}]))
    assert sorted(first_turns(path, 10, seed=0)).count("Name a colour.") + \
        sorted(first_turns(path, 10, seed=0)).count("name a   COLOUR.") == 1


def test_sampled_answers_come_beside_the_greedy_ones(tmp_path, tiny_target_dir, data_file):
    out = regenerate(RegenerateConfig(model_dir=str(tiny_target_dir), out=str(tmp_path / "regen.json"),
                                      data=str(data_file), num_conversations=10, max_prompt_tokens=64,
                                      max_new_tokens=6, batch_size=4, sampled_answers=True))
    kinds = sorted(r["id"][0] for r in json.loads(out.read_text()))
    assert kinds.count("g") == kinds.count("s") >= 1


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="batch_size"):
        RegenerateConfig(model_dir="m", out="o", batch_size=0)
