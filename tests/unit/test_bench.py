"""`specserve bench`'s report on the tiny target: the JSON contract benchmarks read, runs interleaved step by step."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

from specserve.bench import (
    STEPS_PER_TURN,
    EngineRun,
    format_profile,
    output_repetition,
    run_bench,
    run_in_lockstep,
    shape_mix,
)
from specserve.config import EngineConfig, SpecConfig
from specserve.tree import DraftShape


def test_report_has_the_contract_fields_and_the_profile(tmp_path, tiny_target_dir):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in ("a b a b a b", "one two one two", "x y z")))
    config = EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", cpu_compile=False,
                          max_batch_size=2, max_seq_len=256)
    report = run_bench(config, str(data), num_prompts=3, max_new_tokens=8, batch_size=2, hf_baseline=False,
                       specs=[SpecConfig(algorithm="ngram", num_draft_tokens=4)], profile=True)
    assert report["interleaved"] and report["rotated"] and report["lockstep"] and report["num_prompts"] == 3
    assert report["steps_per_turn"] == STEPS_PER_TURN and report["hardware"]["cores"] >= 1
    assert report["kv_cache_dtype"] == "float32"  # a safetensors target's cache keeps its dtype
    assert report["baseline_tokens_per_s"] > 0 and (report["batch_size"], report["max_batch_size"]) == (2, 2)
    row = report["runs"]["ngram"]
    for key in ("tokens_per_s", "accept_length", "speedup", "lossless", "same_output_fraction"):
        assert key in row
    assert row["lossless"] and row["tokens"] == 3 * 8  # fp32: the same tokens as none
    assert not row["adaptive"] and row["shapes"]["chosen"] == {"3/1/4": row["profile_ms"]["steps"]}
    assert row["profile_ms"]["drafting_steps"] == row["profile_ms"]["steps"]  # every step drafts
    assert row["profile_ms"]["draft_forwards"] == 0 and "draft_per_forward" not in row["profile_ms"]  # no draft model
    assert row["profile_ms"]["draft_model"] == 0 and "draft_forward_vs_decode" not in row
    prof = report["baseline_profile_ms"]
    assert prof["drafting_steps"] == 0 and "draft_per_drafting_step" not in prof
    assert prof["steps"] > 0 and abs(prof["total"] - sum(prof[k] for k in
                                     ("draft", "forward", "verify", "drafter_update", "bookkeeping"))) < 0.01
    assert row["shape_mix"] == {"3/1/4": row["profile_ms"]["steps"]}  # steps per draft shape
    assert row["path_mix"] == {} and report["baseline_path_mix"] == {}  # no compiled program: no path chosen
    assert row["start_flagged"] is False and report["baseline_start_flagged"] is False
    assert report["last_half_first_prompt"] == 2 and row["speedup_last_half"] > 0  # chunks of 2: the last one
    assert 0 <= report["baseline_output_repetition"] <= 1
    table = format_profile(report)
    assert table.splitlines()[1].startswith("none") and table.splitlines()[2].startswith("ngram")
    assert "busy start" not in table


def test_the_table_marks_a_run_whose_start_up_timings_were_taken_on_a_busy_machine():
    report = {"baseline_profile_ms": {"total": 15.0}, "baseline_start_flagged": True,
              "runs": {"ngram": {"profile_ms": {"total": 12.0}, "start_flagged": False}}}
    lines = format_profile(report).splitlines()
    assert lines[0].endswith("start") and lines[1].endswith("busy start") and not lines[2].endswith("busy start")


def test_the_shape_mix_counts_plain_steps_the_chooser_was_not_asked_about():
    """disable_by_batch_size: steps at large batches decode plainly without asking the chooser."""
    engine = SimpleNamespace(chooser=SimpleNamespace(chosen=Counter({DraftShape(4, 3, 1): 5, DraftShape(1, 0, 1): 1})),
                             profile=SimpleNamespace(steps=9))
    assert shape_mix(engine) == {"0/1/1": 4, "3/1/4": 5}


def test_output_repetition_counts_n_grams_an_earlier_output_had():
    assert output_repetition([[1, 2, 3, 4], [9, 2, 3, 4, 5], [7, 7]], n=3) == 1 / 5  # (2 3 4) of 2 + 3 + 0
    assert output_repetition([[1, 2, 3], [1, 2, 3]], n=4) == 0


def test_tokens_per_s_from_a_prompt_on_counts_only_those_chunks():
    run = EngineRun(engine=None, max_new_tokens=8)
    run.chunks = [(0, 100, 10.0), (2, 30, 1.0), (4, 30, 2.0)]
    assert run.tokens_per_s_from(2) == 60 / 3.0 and run.tokens_per_s_from(0) == 160 / 13.0


class _CountingRun:
    """What `run_in_lockstep` calls of an `EngineRun`: `steps` steps of work, each logged by name."""

    def __init__(self, name: str, steps: int, log: list[str]) -> None:
        self.name, self.left, self.log = name, steps, log

    def start(self, prompts: list[list[int]], first: int) -> None:
        self.log.append(f"start {self.name}")

    def advance(self) -> bool:
        self.log.append(self.name)
        self.left -= 1
        return self.left > 0

    def finish(self) -> None:
        self.log.append(f"finish {self.name}")


def test_engines_in_lockstep_take_their_steps_in_a_rotating_turn_until_each_is_done():
    log: list[str] = []
    runs = [_CountingRun("a", 3, log), _CountingRun("b", 1, log), _CountingRun("c", 2, log)]
    run_in_lockstep(runs, [[1, 2]], 0, steps_per_turn=1)
    assert log[:3] == ["start a", "start b", "start c"] and log[-3:] == ["finish a", "finish b", "finish c"]
    # round 1: a b c (b done); round 2 starts one later: c a (c done); round 3: a
    assert log[3:-3] == ["a", "b", "c", "c", "a", "a"]
    log.clear()
    runs = [_CountingRun("a", 5, log), _CountingRun("b", 1, log), _CountingRun("c", 2, log)]
    run_in_lockstep(runs, [[1, 2]], 0, steps_per_turn=2)  # up to two steps a turn, none after an engine is done
    assert log[3:-3] == ["a", "a", "b", "c", "c", "a", "a", "a"]
