"""The committed model repository is exactly what `specserve model-repository` writes."""

from __future__ import annotations

from pathlib import Path

from specserve.cli import main
from specserve.serving.repository import VARIANTS, render_repository, stale_files

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
    edited.write_text(edited.read_text().replace('"max_batch_size" value: { string_value: "8" }',
                                                  '"max_batch_size" value: { string_value: "4" }'))
    assert stale_files(tmp_path) == ["llm_ngram/config.pbtxt"]
    assert main(["model-repository", "--model-repository", str(tmp_path), "--check"]) == 1
