"""The structured-output check's verdicts (its server runs are `make structured-check`)."""

from __future__ import annotations

from pathlib import Path

from specserve_client.datasets import load_questions, load_schemas
from specserve_client.structured_check import verdict

SCHEMA = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer", "maximum": 3}}}


def test_verdicts():
    assert verdict('{"n": 2}', "stop", SCHEMA) == "valid"
    assert verdict('{"n": 7}', "stop", SCHEMA) == "invalid"
    assert verdict('{"n": ', "stop", SCHEMA) == "invalid"
    assert verdict('{"n": ', "length", SCHEMA) == "cut"


def test_the_data_sets_pair_every_prompt_with_a_schema():
    bench = Path(__file__).parents[2] / "bench"
    for path, n in ((str(bench / "structured.jsonl"), 32), (str(bench / "structured_heldout.jsonl"), 10)):
        assert len(load_questions(path)) == len(load_schemas(path)) == n
