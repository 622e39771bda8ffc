"""bench/gpu/run.py runs end to end on CPU with a tiny shape (eager only; the numbers mean
nothing), so the script a GPU machine runs cannot rot without one."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "run.py"


def test_gpu_bench_script_runs_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rc = module.main(["--device", "cpu", "--shape", "tiny", "--batch-sizes", "1,2", "--num-draft-tokens", "4,8",
                      "--context", "32", "--iters", "2", "--skip-variants", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    steps = report["steps"]
    assert [r["batch_size"] for r in steps["decode"]] == [1, 2]
    assert [r["num_draft_tokens"] for r in steps["verify"]] == [4, 8]
    assert steps["weight_bytes"] > 0 and steps["bandwidth_floor_ms"] > 0
    assert all(r["eager_ms"] > 0 and "graph_ms" not in r for r in steps["decode"])  # no capture on CPU
    assert "| 8 |" in (tmp_path / "gpu_bench.md").read_text()


def test_variants_part_writes_one_json_as_it_goes(tmp_path, tiny_target_dir):
    """The variants part as check.sh runs it (one JSON, rewritten after each row), pinned and
    adaptive shapes, on the tiny target on CPU."""
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "variants.json"
    rc = module.main(["--device", "cpu", "--skip-steps", "--model-dir", str(tiny_target_dir), "--algorithms",
                      "none,ngram", "--num-prompts", "1", "--max-new-tokens", "4", "--graphs-only", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["variants"]
    assert [(r["algorithm"], r["shape"]) for r in rows] == [("none", "pinned"), ("ngram", "pinned"),
                                                            ("ngram", "adaptive")]
    assert all(r["tokens_per_s"] > 0 and not r["cuda_graph"] for r in rows)


def test_check_script_parses():
    import subprocess

    subprocess.run(["bash", "-n", str(SCRIPT.parent / "check.sh")], check=True)


def test_hf_static_baseline_keeps_one_cache_for_prompts_of_every_length(tiny_target_dir):
    """HF generate() with one static cache, reset between prompts of different lengths (so a GPU
    compiles its forward once), generates what it is asked to."""
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import torch

    row = module.hf_static_generate(str(tiny_target_dir), torch.device("cpu"), [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]], 4)
    assert row["algorithm"] == "hf_generate_static_cache" and row["tokens_per_s"] > 0
    assert row["cache_len"] == 7 + 4


def test_make_gpu_check_writes_into_out_when_it_is_set(tmp_path):
    """The device machine returns only what a command leaves in $OUT: `make gpu-check` must write there."""
    import os
    import subprocess

    repo = Path(__file__).parents[2]
    said = subprocess.run(["make", "-s", "-n", "gpu-check"], cwd=repo, capture_output=True, text=True, check=True,
                          env={**os.environ, "OUT": str(tmp_path)}).stdout.strip()
    assert said.startswith("bench/gpu/check.sh ")
    expanded = subprocess.run(["bash", "-c", f"echo {said.split(' ', 1)[1]}"], capture_output=True, text=True,
                              env={**os.environ, "OUT": str(tmp_path)}).stdout.strip()
    assert expanded == str(tmp_path)
    default = subprocess.run(["bash", "-c", f"echo {said.split(' ', 1)[1]}"], capture_output=True, text=True,
                             env={k: v for k, v in os.environ.items() if k != "OUT"}).stdout.strip()
    assert default == "results/gpu-check"
