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


EXPECTED_OUT = {"summary.txt", "check.log", "kernels.xml", "gpu_tests.xml", "steps_smollm2.json", "steps_llama8b.json",
                "variants.json", "hf_static.json"}


def test_check_rehearsal_leaves_its_files_in_out(tmp_path):
    """bench/gpu/check.sh end to end on the CPU with tiny shapes (REHEARSAL=1), the random-weight
    model it writes when none is prepared included: at most the 8 files the device machine returns,
    a summary line per part, each part successful, and the capture failures counted."""
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    env = {**os.environ, "REHEARSAL": "1", "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    env.pop("SPECSERVE_GPU_MODEL_DIR", None)
    subprocess.run(["bash", str(SCRIPT.parent / "check.sh"), str(out)], env=env, check=True, timeout=600,
                   capture_output=True)
    names = {p.name for p in out.iterdir()}
    assert names == EXPECTED_OUT, names
    summary = (out / "summary.txt").read_text().splitlines()
    parts = [line.split(":")[0] for line in summary if ": rc=" in line]
    assert parts == ["random-model", "kernels", "gpu-tests", "steps-smollm2", "steps-llama8b", "profile", "variants",
                     "hf-static"]
    assert all(": rc=0," in line for line in summary if ": rc=" in line), summary
    assert any(line.startswith("capture failures: 0 (") and "variants.json 0" in line for line in summary), summary
    assert any(line in ("prompts: mtbench", "prompts: bench/chat_heldout.jsonl") for line in summary), summary
    rows = json.loads((out / "variants.json").read_text())["variants"]
    assert rows and all(r["capture_failures"] == 0 and r["cuda_graph"] is False for r in rows)


def test_a_failed_capture_is_counted_and_is_no_graph(monkeypatch):
    """A bucket whose capture fails runs eagerly: its row says so (`graph_captured` false, one
    capture failure) and the summary counts it. On the CPU every capture fails (no CUDA stream)."""
    import torch

    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    report = module.bench_steps(module.SHAPES["tiny"], torch.device("cpu"), [1], [4], context=16, iters=1,
                                graphs=True, attention="torch")
    rows = [*report["decode"], *report["verify"]]
    assert [(r["graph_captured"], r["capture_failures"]) for r in rows] == [(False, 1), (False, 1)]
    assert module.capture_failures({"steps": report}) == 2
