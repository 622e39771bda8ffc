"""The genai-perf profile driver: the command it runs and how it reads genai-perf's export."""

from __future__ import annotations

import json
from pathlib import Path

from specserve_client.profile import figures, genai_perf_command, write_report

EXPORT = Path(__file__).parents[2] / "bench/measured/2026-11-23-sdpa/genai_perf/profile_export_genai_perf.json"


def test_the_command_is_a_streaming_kserve_vllm_profile_without_warmup(tmp_path):
    cmd = genai_perf_command(Path("gp"), "localhost:8001", "llm_none", "vllm", "models/m", 4, 16, 128, 64, tmp_path)
    line = " ".join(cmd)
    assert cmd[:2] == ["gp", "profile"] and "--streaming" in cmd
    assert ("--endpoint-type kserve --backend vllm" in line and "--concurrency 4" in line
            and "--request-count 16" in line)
    assert "-m llm_none" in line and f"--artifact-dir {tmp_path}" in line
    assert "warmup" not in line  # tritonclient 2.50's perf_analyzer never ends a decoupled measurement with it


def test_a_structured_profile_sends_the_schema_as_guided_decoding_tensors(tmp_path):
    schema = '{"type":"object"}'
    cmd = genai_perf_command(Path("gp"), "localhost:8001", "llm_none", "vllm", "models/m", 1, 16, 128, 64, tmp_path,
                             {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": schema})
    assert cmd[-2] == "--extra-inputs"
    assert json.loads(cmd[-1]) == {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": schema}


def test_figures_are_genai_perfs_own(tmp_path):
    data = json.loads(EXPORT.read_text())
    got = figures(EXPORT)
    assert got["output_tokens_per_s"] == round(data["output_token_throughput"]["avg"], 2)
    assert got["mean_ttft_ms"] == round(data["time_to_first_token"]["avg"], 2)
    assert got["p90_latency_ms"] == round(data["request_latency"]["p90"], 2)
    write_report(tmp_path, [{"concurrency": 2, **got}], {"model": "llm_none", "genai_perf_version": "0.0.16"})
    table = (tmp_path / "profile.md").read_text().splitlines()
    assert table[2].startswith("| concurrency | output_tokens_per_s") and table[4].startswith("| 2 | ")
    assert json.loads((tmp_path / "profile.json").read_text())["points"][0]["concurrency"] == 2
