"""regenerate-data on a tiny target: the prompts it keeps, the corpus it appends to (resumed, cut by
a kill), and that the answers are the engine's own greedy outputs."""

from __future__ import annotations

import json

import pytest

from specserve.config import EngineConfig, SamplingParams
from specserve.engine.engine import Engine
from specserve.prompts import hf_tokenizer, render_chat
from specserve.training.corpus import Corpus
from specserve.training.data import training_samples
from specserve.training.regenerate import RegenerateConfig, first_turns, loop_cut, regenerate

CONVERSATIONS = [
    {"id": "0", "conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}]},
    {"id": "1", "conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "Count to three."},
                                  {"from": "gpt", "value": "1 2 3"}]},
    {"id": "2", "conversations": [{"from": "human", "value": "word " * 400}, {"from": "gpt", "value": "ok"}]},
]


def test_first_turns_are_the_users_first_messages(data_file):
    assert sorted(first_turns(data_file, 10, seed=0)) == sorted(["Name a colour.", "Count to three.", "word " * 400])


def regen(tmp_path, tiny_target_dir, data_file, **kw):
    return regenerate(RegenerateConfig(model_dir=str(tiny_target_dir), out=str(tmp_path / "corpus"),
                                       data=str(data_file), max_prompt_tokens=64, max_new_tokens=6, batch_size=2,
                                       dtype="float32", **kw))


def test_regenerate_appends_the_targets_greedy_answers(tmp_path, tiny_target_dir, data_file):
    corpus = Corpus(regen(tmp_path, tiny_target_dir, data_file))
    assert len(corpus.rows) == 2  # the 400-word prompt does not fit in 64
    engine = Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", cpu_compile=False,
                                 max_batch_size=1, max_seq_len=128))
    by_ids = {tuple(ids[:p].tolist()): ids[p:].tolist() for ids, p in corpus.samples(512)}
    for prompt in ("Name a colour.", "Count to three."):
        ids = engine.tokenizer.encode(render_chat(str(tiny_target_dir), prompt), add_special_tokens=False).ids
        out_ids = engine.generate([ids], SamplingParams(max_tokens=6))[0].token_ids
        answer = by_ids[tuple(ids)]  # the prompt exactly as served
        cut = loop_cut(out_ids[:-1]) is not None or loop_cut(out_ids) is not None
        assert answer == out_ids or (cut and out_ids[: len(answer)] == answer)
    # train-drafter reads the corpus as it is: prompt ids, then the answer ids, only those masked
    tok = hf_tokenizer(str(tiny_target_dir))
    samples = training_samples(tok, str(tmp_path / "corpus"), 10, 512, seed=0)
    assert sorted(samples) == sorted((ids.tolist(), [False] * p + [True] * (len(ids) - p))
                                     for ids, p in corpus.samples(512))


def test_a_second_run_goes_on_where_the_corpus_ends(tmp_path, tiny_target_dir, data_file):
    regen(tmp_path, tiny_target_dir, data_file, num_conversations=1)
    first = Corpus(tmp_path / "corpus").rows
    assert len(first) <= 1
    regen(tmp_path, tiny_target_dir, data_file)
    rows = Corpus(tmp_path / "corpus").rows
    assert rows[: len(first)] == first and len(rows) == 2 and len({r.key for r in rows}) == 2
    regen(tmp_path, tiny_target_dir, data_file)  # nothing left to answer
    assert Corpus(tmp_path / "corpus").rows == rows
    with pytest.raises(ValueError, match="other settings"):
        regen(tmp_path, tiny_target_dir, data_file, temperature=0.5)


def test_a_corpus_cut_by_a_kill_keeps_its_whole_rows(tmp_path):
    meta = {"model": "m"}
    corpus = Corpus(tmp_path, meta)
    corpus.append("a", "src", [1, 2, 3], [4, 5], cut=False)
    corpus.append("b", "src", [6], [7, 8, 9], cut=True)
    with open(tmp_path / "tokens.u16", "ab") as f:
        f.write(b"\x01\x00\x02")  # a row's ids written, its line not
    with open(tmp_path / "rows.jsonl", "a") as f:
        f.write('{"key": "c", "sou')  # a line cut short
    again = Corpus(tmp_path, meta)
    assert [r.key for r in again.rows] == ["a", "b"] and again.answer_tokens == 5
    assert [(ids.tolist(), p) for ids, p in again.samples(4)] == [([1, 2, 3, 4], 3), ([6, 7, 8, 9], 1)]
    assert again.append("c", "src", [1], [2], cut=False).start == 9
    with pytest.raises(ValueError, match="uint16"):
        again.append("d", "src", [70000], [1], cut=False)
    with pytest.raises(ValueError, match="other settings"):
        Corpus(tmp_path, {"model": "other"})
    with pytest.raises(FileNotFoundError, match="regenerate-data"):
        Corpus(tmp_path / "missing")


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
    corpus = Corpus(regen(tmp_path, tiny_target_dir, data_file, sampled_answers=True))
    assert len(corpus.rows) == 4 and len({r.key for r in corpus.rows}) == 4  # two answers to each prompt


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="batch_size"):
        RegenerateConfig(model_dir="m", out="o", batch_size=0)


def test_exported_prompts_are_what_regenerate_draws(tmp_path, data_file):
    """A prompts file (what a GPU machine without the ShareGPT package answers from) holds the
    same prompts in the same order."""
    from specserve.training.regenerate import export_prompts

    path = export_prompts(tmp_path / "prompts.jsonl", str(data_file), 10, seed=3)
    assert first_turns(path, 10, seed=0) == first_turns(data_file, 10, seed=3)
    assert first_turns(path, 2, seed=0) == first_turns(data_file, 10, seed=3)[:2]


def test_regenerate_stops_once_the_corpus_holds_the_answer_tokens_asked_for(tmp_path, tiny_target_dir, data_file):
    corpus = Corpus(regenerate(RegenerateConfig(model_dir=str(tiny_target_dir), out=str(tmp_path / "corpus"),
                                                data=str(data_file), max_prompt_tokens=64, max_new_tokens=6,
                                                batch_size=1, dtype="float32", max_answer_tokens=1)))
    assert len(corpus.rows) == 1 and corpus.answer_tokens >= 1  # the first answer suffices


def test_if_the_engine_fails_hf_generate_makes_the_same_answers(tmp_path, tiny_target_dir, data_file, monkeypatch):
    """The fallback answers the prompts the engine left, greedy answers equal to the engine's own."""
    import specserve.engine.engine as engine_module

    reference = Corpus(regen(tmp_path / "engine", tiny_target_dir, data_file))

    def broken(self, config):  # noqa: ANN001
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(engine_module.Engine, "__init__", broken)
    fallback = Corpus(regen(tmp_path / "hf", tiny_target_dir, data_file))
    assert sorted((ids.tolist(), p) for ids, p in fallback.samples(512)) == \
        sorted((ids.tolist(), p) for ids, p in reference.samples(512))
