"""One name per drafting method, from the config to the model directory, with the earlier names
accepted; each method's behaviour comes from its registry entry."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specserve.cli import build_parser, main
from specserve.config import SpecConfig
from specserve.methods import ALGORITHMS, ALIASES, HEAD_METHODS, METHODS, canonical, method
from specserve.models.draft_heads import HEADS
from specserve.models.eagle_head import HEAD_CLASSES
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
    names = "none, ngram, eagle, eagle3, mtp, standalone, suffix, hybrid"
    assert f"error: algorithm: must be one of {names}, got 'medusa'" in capsys.readouterr().err


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


CLIENT_MIRROR = REPO / "client" / "specserve_client" / "variants.py"  # the client imports nothing of specserve


def _code_files() -> list[Path]:
    """Every Python file of the server package, the client and the benchmarks but the registry."""
    files = [p for d in (BACKEND, REPO / "client", REPO / "bench") for p in d.rglob("*.py")]
    return [p for p in files if p != BACKEND / "methods.py"]


def _method_name_tables(path: Path) -> list[str]:
    """dict / tuple / list / set literals with two or more methods' names as keys or items: a
    per-method table kept somewhere other than `methods.METHODS`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        items = (node.keys if isinstance(node, ast.Dict)
                 else node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [])
        names = {i.value for i in items if isinstance(i, ast.Constant) and (i.value in METHODS or i.value in ALIASES)}
        if len(names) >= 2:
            found.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:"
                         f"{node.lineno} {sorted(names)}")
    return found


def test_no_code_tests_a_method_name():
    files = _code_files()
    assert len(files) > 80 and [hit for p in files for hit in _method_name_tests(p)] == []


def test_per_method_facts_live_in_one_table():
    """Outside methods.py nothing lists methods by name; the client's copy of the aliases (it imports
    nothing of specserve) is the one exception, kept equal to them above."""
    hits = [hit for p in _code_files() if p != CLIENT_MIRROR for hit in _method_name_tables(p)]
    assert hits == []
    assert _method_name_tables(CLIENT_MIRROR)  # the check sees the one table it lets through


def test_the_check_finds_a_table_and_a_name_test(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('SHAPES = {"eagle": 1, "mtp": 2}\nif algorithm == "ngram":\n    pass\n')
    assert len(_method_name_tables(bad)) == 1 and len(_method_name_tests(bad)) == 1


def test_aliases_are_resolved_in_one_place():
    """Only methods.py reads ALIASES (through `renamed` / `canonical`)."""
    def reads_aliases(path: Path) -> bool:
        return any(isinstance(n, ast.Name) and n.id == "ALIASES" or isinstance(n, ast.alias) and n.name == "ALIASES"
                   for n in ast.walk(ast.parse(path.read_text())))

    assert [p.relative_to(REPO) for p in _code_files() if reads_aliases(p)] == []


def test_a_method_is_built_from_its_row(monkeypatch):
    """The drafter class comes from the row: a new method needs no table besides METHODS."""
    import dataclasses
    import types

    from specserve.drafters import factory
    from specserve.drafters.base import NoDrafter

    row = dataclasses.replace(METHODS["none"], name="plain2", drafter="specserve.drafters.base:NoDrafter")
    monkeypatch.setitem(METHODS, "plain2", row)
    spec = types.SimpleNamespace(method=row)  # what build_drafter reads of a SpecConfig
    built = []
    monkeypatch.setattr(NoDrafter, "build", classmethod(lambda cls, spec, ctx: built.append(cls) or "drafter"))
    assert factory.build_drafter(spec, None) == "drafter" and built == [NoDrafter]
