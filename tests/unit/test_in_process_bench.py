"""servebench's in-process figures come from the server package's `specserve in-process-bench`,
run as a subprocess: llm_<variant>'s engine (config.pbtxt parameters, --num-threads applied) on the
dataset's prompts in the chat template, greedy, as JSON; on a tiny target here."""

from __future__ import annotations

import json
import os
from pathlib import Path

from specserve.engine.engine import Engine
from specserve.serving.parameters import engine_config_from_parameters
from specserve.serving.tokenizer import PromptTokenizer
from specserve_client import servebench
from specserve_client.datasets import load_prompts

ROOT = Path(__file__).resolve().parents[2]


def _repository(root: Path, model_dir: Path) -> dict[str, str]:
    params = {"model_dir": str(model_dir), "algorithm": "none", "device": "cpu", "dtype": "float32",
              "disable_cpu_compile": "true", "max_batch_size": "1", "max_seq_len": "256"}
    (root / "llm_none").mkdir(parents=True)
    (root / "llm_none" / "config.pbtxt").write_text("".join(
        f'parameters: {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items()))
    return params


def test_servebench_reads_the_in_process_figures_of_the_server_command(tmp_path, tiny_target_dir, monkeypatch):
    from specserve.config import SamplingParams

    params = _repository(tmp_path / "repo", tiny_target_dir)
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in ("Name a colour.", "Count to three.")))
    here = [str(ROOT / d) for d in ("backend", "kernels", "client")]  # this checkout's packages in the subprocess
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*here, os.environ.get("PYTHONPATH", "")]))

    result = servebench.in_process("none", str(dataset), 3, 5, tmp_path / "repo", 1)

    assert result["engine"] == {"algorithm": "none", "max_batch_size": "1", "max_seq_len": "256",
                                "dtype": "float32", "num_threads": "1"}
    assert (result["variant"], result["num_prompts"], result["max_tokens"]) == ("none", 3, 5)
    assert result["tokens"] == sum(len(ids) for ids in result["token_ids"]) > 0
    assert result["tokens_per_s"] == result["tokens"] / result["seconds"]
    # the greedy tokens of the same engine run here on the same prompts, chat template applied
    tokenizer = PromptTokenizer(tiny_target_dir)
    prompt_ids = [tokenizer.encode(q, True) for q in load_prompts(str(dataset), 3)]
    engine = Engine(engine_config_from_parameters(params))
    expected = engine.generate(prompt_ids, SamplingParams(max_tokens=5))
    assert result["token_ids"] == [o.token_ids for o in expected]
