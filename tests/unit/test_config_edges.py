"""Every engine knob reaches both edges with the dataclass's default: the `specserve generate/bench`
flags and the llm models' config.pbtxt parameters, both generated from `config.knobs()`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from specserve.cli import _engine_config, build_parser
from specserve.config import EngineConfig, Knob, SpecConfig, knobs
from specserve.prepare import default_model_dir
from specserve.serving.parameters import (
    SERVING_PARAMETERS,
    default_text,
    engine_config_from_parameters,
    parameter_text,
)
from specserve.serving.repository import VARIANTS, llm_config, llm_parameters
from specserve.serving.server import read_parameters

REPO = Path(__file__).resolve().parents[2] / "model_repository"
FLAGS = [k for k in knobs() if not k.no_flag]
PARAMS = [k for k in knobs() if not k.no_param]


def _field(config: EngineConfig, k: Knob) -> Any:
    return getattr(config.spec if k.field in SpecConfig.__dataclass_fields__ else config, k.field)


def _other(k: Knob) -> Any:
    """A value of the knob's field that is neither its default nor what the default resolves to."""
    resolved = _field(EngineConfig(model_dir="m"), k) if k.default is not dataclasses.MISSING else None
    if k.switch:
        return k.switch[1]
    if k.type is bool:
        return not k.default
    if k.choices:
        return next(c for c in k.choices if c not in (k.default, resolved))
    if k.type is float and 0 < k.default < 1:  # a fraction
        return k.default / 2
    if k.type in (int, float):
        return k.type((k.default or 0) + 2)
    return "/other"


def _with(base: EngineConfig, k: Knob, value: Any) -> EngineConfig:
    """The dataclass with one field changed, its `auto` fields resolved again: dtype follows the device
    and load_format, load_format the model directory, device and dtype, kv_cache_dtype the dtype."""
    if k.field in SpecConfig.__dataclass_fields__:
        return dataclasses.replace(base, spec=dataclasses.replace(base.spec, **{k.field: value}))
    unresolved = {f.name: getattr(base, f.name) for f in dataclasses.fields(EngineConfig)}
    unresolved.update({name: "auto" for name in ("device", "dtype", "load_format", "kv_cache_dtype")})
    return EngineConfig(**{**unresolved, k.field: value})


def _assert_only(config: EngineConfig, base: EngineConfig, changed: Knob | None, value: Any = None) -> None:
    """Every knob's field equals the dataclass's with `changed` alone set to `value` (which it holds)."""
    if changed is not None:
        base = _with(base, changed, value)
    for k in knobs():
        if k is changed:
            assert _field(config, k) == value, k.edge
        elif k.field != "model_dir":
            assert _field(config, k) == _field(base, k), f"{k.edge} differs from the dataclass default"


def test_every_field_is_a_knob_with_help_and_its_own_edge_name():
    fields = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "spec"]
    fields += [f.name for f in dataclasses.fields(SpecConfig)]
    assert sorted(k.field for k in knobs()) == sorted(fields)  # a field without a Knob fails in knobs()
    assert len({k.edge for k in knobs()} | set(SERVING_PARAMETERS)) == len(knobs()) + len(SERVING_PARAMETERS)
    for k in knobs():
        assert k.help, k.field
        assert not (k.no_flag and k.no_param), f"{k.field} reaches no edge"
        assert not k.switch or k.default in k.switch, k.field


# ---- the CLI --------------------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text("{}")  # all `_engine_config` looks for
    return str(tmp_path)


def _cli_config(model_dir: str, *argv: str) -> EngineConfig:
    args = build_parser().parse_args(["bench", "--model-dir", model_dir, *argv])
    return _engine_config(args, "none", EngineConfig.max_batch_size)


def _argv(k: Knob, value: Any) -> list[str]:
    if k.switch:
        return [k.flag]
    if k.type is bool:
        return [k.flag if value else f"--no-{k.flag[2:]}"]
    return [k.flag, str(value)]


def test_the_cli_defaults_are_the_dataclass_defaults(model_dir):
    config = _cli_config(model_dir)
    base = EngineConfig(model_dir=model_dir, max_queue_size=0)  # generate and bench queue without bound
    _assert_only(config, base, None)
    assert config == base


@pytest.mark.parametrize("k", FLAGS, ids=lambda k: k.flag)
def test_each_flag_sets_its_field(k, model_dir, tmp_path):
    value = _other(k)
    if k.field == "model_dir":
        value = str(tmp_path / "other")
        Path(value).mkdir()
        (Path(value) / "config.json").write_text("{}")
    config = _cli_config(model_dir, *_argv(k, k.to_edge(value)))
    _assert_only(config, EngineConfig(model_dir=model_dir, max_queue_size=0), k, value)


def test_existing_flag_names_still_parse(model_dir):
    config = _cli_config(model_dir, "--disable-cuda-graph", "--disable-cpu-compile", "--no-adaptive",
                         "--attention-backend", "torch", "--ngram-match-type", "PROB")
    assert (config.graph_mode, config.cpu_compile, config.spec.adaptive) == ("off", False, False)
    args = build_parser().parse_args(["bench", "--algorithm", "eagle", "--model-dir", model_dir])
    assert _engine_config(args, args.algorithm, 1).spec.algorithm == "eagle"


# ---- config.pbtxt ---------------------------------------------------------------------------


def test_the_parameter_defaults_are_the_dataclass_defaults():
    base = EngineConfig(model_dir=str(default_model_dir()))
    assert engine_config_from_parameters({}) == base
    written = {k.edge: default_text(k) for k in PARAMS}  # every default spelled out parses back to itself
    assert engine_config_from_parameters(written) == base


@pytest.mark.parametrize("k", PARAMS, ids=lambda k: k.edge)
def test_each_parameter_sets_its_field(k):
    value = _other(k)
    config = engine_config_from_parameters({k.edge: parameter_text(k.to_edge(value))})
    _assert_only(config, EngineConfig(model_dir=str(default_model_dir())), k, value)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_each_committed_llm_config_is_generated_and_sets_only_its_variant(variant):
    path = REPO / f"llm_{variant.name}" / "config.pbtxt"
    assert path.read_text() == llm_config(variant), "run `specserve model-repository` and commit the result"
    params = read_parameters(path)
    assert params == llm_parameters(variant)
    config = engine_config_from_parameters(params)
    set_here = {k.field for k in PARAMS if k.edge in params}
    for k in knobs():
        if k.field not in set_here and k.field != "model_dir":
            assert _field(config, k) == _field(EngineConfig(model_dir=config.model_dir), k), f"{variant.name}: {k.edge}"
    assert config.spec.algorithm == variant.algorithm


# ---- instances ------------------------------------------------------------------------------


@pytest.mark.parametrize("device_id", ["0", "3"])
def test_a_kind_gpu_instance_runs_on_the_gpu_triton_placed_it_on(device_id):
    """`instance_group [{kind: KIND_GPU, gpus: [0, 3]}]`: Triton builds one instance per GPU and
    passes its kind and device id to `initialize`; each engine goes there."""
    config = engine_config_from_parameters({}, "GPU", device_id)
    assert (config.device, config.dtype) == (f"cuda:{device_id}", "bfloat16")
    assert engine_config_from_parameters({"device": "cuda"}, "GPU", device_id).device == f"cuda:{device_id}"
    assert (engine_config_from_parameters({"device": f"cuda:{device_id}"}, "GPU", device_id).device
            == f"cuda:{device_id}")


def test_kind_cpu_and_kind_model_instances_keep_the_device_parameter():
    assert engine_config_from_parameters({"device": "cpu"}, "CPU", "0").device == "cpu"
    assert engine_config_from_parameters({"device": "cuda:1"}, "MODEL", "0").device == "cuda:1"
    assert engine_config_from_parameters({}, "CPU", "0") == engine_config_from_parameters({})


@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
def test_a_device_parameter_that_contradicts_a_kind_gpu_instance_is_an_error(device):
    with pytest.raises(ValueError, match=r"^device: .* placed this KIND_GPU instance on cuda:0"):
        engine_config_from_parameters({"device": device}, "GPU", "0")
