"""bench/gpu/run.py runs end to end on CPU with a tiny shape (eager only; the numbers mean
nothing), so the script the device tool runs cannot rot between GPU sessions."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "run.py"


def test_gpu_bench_script_runs_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rc = module.main(["--device", "cpu", "--shape", "tiny", "--batch-sizes", "1,2", "--tree-tokens", "4,8",
                      "--context", "32", "--iters", "2", "--skip-variants", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    steps = report["steps"]
    assert [r["batch_size"] for r in steps["decode"]] == [1, 2]
    assert [r["tree_tokens"] for r in steps["verify"]] == [4, 8]
    assert steps["weight_bytes"] > 0 and steps["bandwidth_floor_ms"] > 0
    assert all(r["eager_ms"] > 0 and "graph_ms" not in r for r in steps["decode"])  # no capture on CPU
    assert "| 8 |" in (tmp_path / "gpu_bench.md").read_text()
