"""bench/ab.py: the ABBA order of the runs and the summary of two sides' `specserve bench` reports
(the benchmark itself stubbed: the order and arithmetic are what is tested here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "ab.py"


@pytest.fixture
def ab():
    spec = importlib.util.spec_from_file_location("ab", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(none: float, ngram: float) -> dict:
    return {"baseline_tokens_per_s": none, "runs": {"ngram": {"tokens_per_s": ngram}}}


def test_the_sides_alternate_abba(ab):
    assert ab.order(1) == ["before", "after"]
    assert ab.order(3) == ["before", "after", "after", "before", "before", "after"]


def test_the_summary_gives_every_run_the_means_and_their_ratio(ab):
    rows = ab.summarize([_report(60, 80), _report(62, 82)], [_report(61, 72), _report(61, 76)])
    assert rows["none"] == {"before": [60, 62], "after": [61, 61], "before_mean": 61.0, "after_mean": 61.0,
                            "ratio": 1.0}
    assert rows["ngram"]["ratio"] == pytest.approx(74 / 81, abs=1e-3)


def test_a_run_writes_every_report_and_the_summary(ab, tmp_path, monkeypatch, capsys):
    calls = []

    def fake_bench(tree, bench_args, json_path):
        calls.append((tree.name, json_path.name, list(bench_args)))
        report = _report(60.0, 70.0 if tree.name == "old" else 77.0)
        json_path.write_text(json.dumps(report))
        return report

    monkeypatch.setattr(ab, "worktree", lambda rev, trees: tmp_path / rev)
    monkeypatch.setattr(ab, "run_bench", fake_bench)
    out = tmp_path / "ab"
    assert ab.main(["old", "new", "--rounds", "2", "--out", str(out), "--", "--algorithm", "ngram"]) == 0
    assert [(tree, name) for tree, name, _ in calls] == [("old", "before1.json"), ("new", "after1.json"),
                                                         ("new", "after2.json"), ("old", "before2.json")]
    assert all(args == ["--algorithm", "ngram"] for _, _, args in calls)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["methods"]["ngram"]["ratio"] == 1.1 and summary["order"] == ab.order(2)
    assert "ngram" in capsys.readouterr().out
