"""The committed model repository is exactly what `specserve model-repository` writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.cli import main
from specserve.serving.repository import (
    IDENTIFYING,
    README,
    VARIANTS,
    Variant,
    llm_parameters,
    parameter_defaults,
    parameter_table,
    render_repository,
    stale_files,
    write_repository,
)

REPO = Path(__file__).resolve().parents[2] / "model_repository"


def test_committed_repository_equals_the_generated_one():
    assert stale_files(REPO) == [], "run `specserve model-repository` and commit the result"


def test_every_variant_has_its_three_parts_and_the_check_catches_an_edit(tmp_path):
    files = render_repository()
    for v in VARIANTS:
        assert f'model_name: "llm_{v.name}"' in files[f"ensemble_{v.name}/config.pbtxt"]
        assert f'key: "algorithm" value: {{ string_value: "{v.algorithm}" }}' in files[f"llm_{v.name}/config.pbtxt"]
    assert main(["model-repository", "--model-repository", str(tmp_path)]) == 0
    assert main(["model-repository", "--model-repository", str(tmp_path), "--check"]) == 0
    edited = tmp_path / "llm_ngram" / "config.pbtxt"
    edited.write_text(edited.read_text() + 'parameters: { key: "max_batch_size" value: { string_value: "4" } }\n')
    assert stale_files(tmp_path) == ["llm_ngram/config.pbtxt"]
    assert main(["model-repository", "--model-repository", str(tmp_path), "--check"]) == 1


def test_llm_configs_are_short_and_set_only_what_differs_from_the_defaults():
    defaults = parameter_defaults()
    for v in VARIANTS:
        text = render_repository()[f"llm_{v.name}/config.pbtxt"]
        assert len(text.splitlines()) <= 40 and "input [" not in text and "output [" not in text
        params = llm_parameters(v)
        assert list(params)[:2] == ["model_dir", "algorithm"]
        assert all(value != defaults[key] for key, value in params.items() if key not in IDENTIFYING)
    with pytest.raises(ValueError, match="^max_batch_sise:"):
        llm_parameters(Variant("none", {"max_batch_sise": "4"}))


def test_the_readme_table_is_regenerated_and_checked(tmp_path):
    (tmp_path / README).write_text((REPO / README).read_text())
    write_repository(tmp_path)
    assert stale_files(tmp_path) == []
    readme = tmp_path / README
    readme.write_text(readme.read_text().replace("| `max_queue_size` |", "| `max_queue_len` |"))
    assert stale_files(tmp_path) == [README]
    assert parameter_table() in (REPO / README).read_text()
