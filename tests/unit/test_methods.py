"""One name per drafting method, from the config to the model directory, with the earlier names
accepted; each method's behaviour comes from its registry entry."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specserve.cli import build_parser, main
from specserve.config import SpecConfig
from specserve.drafters.eagle_model import HEADS as HEAD_CLASSES
from specserve.drafters.heads import HEADS
from specserve.methods import ALGORITHMS, ALIASES, HEAD_METHODS, METHODS, canonical, method
from specserve.serving.repository import VARIANTS, served_drafter
from specserve.serving.server import list_variants
from specserve.training.configs import RECIPES, HeadsConfig, TrainConfig
from specserve_client.variants import RENAMED

REPO = Path(__file__).resolve().parents[2]
BACKEND = REPO / "backend" / "specserve"


def test_every_served_variant_is_named_after_its_method():
    assert [v.name for v in VARIANTS] == list(ALGORITHMS)
    assert list_variants(REPO / "model_repository") == sorted(ALGORITHMS)
    for v in VARIANTS:
        text = (REPO / "model_repository" / f"llm_{v.name}" / "config.pbtxt").read_text()
        assert f'key: "algorithm" value: {{ string_value: "{v.name}" }}' in text


def test_earlier_names_are_aliases_everywhere_a_method_is_named():
    assert ALIASES == {"base": "none", "eagle2": "eagle"} == RENAMED
    assert SpecConfig(algorithm="eagle2").algorithm == "eagle"
    assert SpecConfig(algorithm="base").resolved() == SpecConfig(algorithm="none").resolved()
    assert TrainConfig(algorithm="eagle2", model_dir="m", out_dir="o").algorithm == "eagle"
    assert HeadsConfig(corpus="c", model_dir="m", out_dir="o", algorithms=("eagle2",)).algorithms == ("eagle",)
    assert served_drafter("eagle2") == served_drafter("eagle") != {}
    assert build_parser().parse_args(["generate", "--prompt", "x"]).variant == "none"
    assert build_parser().parse_args(["train-drafter", "--algorithm", "eagle2", "--out", "o"]).algorithm == "eagle"
    with pytest.raises(ValueError, match="^algorithm: must be one of none, ngram, eagle, eagle3, mtp, standalone"):
        canonical("medusa")


def test_bench_names_an_unknown_method(capsys):
    assert main(["bench", "--algorithm", "eagle2,medusa"]) == 2
    assert "error: algorithm: must be one of none, ngram, eagle, eagle3, mtp, standalone, got 'medusa'" in \
        capsys.readouterr().err


def test_head_methods_have_a_format_a_recipe_and_head_classes_agree():
    assert set(HEAD_METHODS) == set(HEADS) == set(RECIPES) == {"eagle", "eagle3", "mtp"}
    for name, cls in HEAD_CLASSES.items():
        assert HEADS[name].name == cls.algorithm == name
        assert method(name).fuses_layers == (cls.fused_layers > 1)
    assert not method("eagle3").token_map and method("eagle").token_map and method("mtp").token_map


@pytest.mark.parametrize(("name", "configured", "shape"), [
    ("none", (5, 4, 8), (0, 1, 1)),
    ("ngram", (0, 0, 0), (11, 1, 12)),
    ("ngram", (0, 0, 6), (5, 1, 6)),
    ("eagle", (0, 0, 0), (5, 4, 8)),
    ("eagle3", (3, 1, 0), (3, 1, 4)),
    ("mtp", (0, 0, 0), (1, 2, 3)),
    ("mtp", (3, 0, 0), (3, 4, 8)),
    ("standalone", (0, 2, 6), (5, 2, 6)),
])
def test_default_tree_shapes_come_from_the_method(name, configured, shape):
    steps, topk, tokens = configured
    spec = SpecConfig(algorithm=name, num_steps=steps, topk=topk, num_draft_tokens=tokens).resolved()
    assert (spec.num_steps, spec.topk, spec.num_draft_tokens) == shape


def _method_name_tests(path: Path) -> list[str]:
    """`x == "eagle3"`-style comparisons of anything with a method's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            names = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
            names += [e.value for c in node.comparators if isinstance(c, ast.Tuple | ast.List | ast.Set)
                      for e in c.elts if isinstance(e, ast.Constant)]
            found += [f"{path.name}:{node.lineno}" for n in names if n in METHODS or n in ALIASES]
    return found


def test_models_drafters_engine_and_training_never_test_a_method_name():
    files = [p for d in ("models", "runtime", "drafters", "engine", "training") for p in (BACKEND / d).glob("*.py")]
    assert files and [hit for p in files for hit in _method_name_tests(p)] == []
