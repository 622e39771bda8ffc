"""Every field of the training commands' configs is a knob: a flag of its command (generated from
`config.config_knobs`) with the dataclass's default, or a field that says why it is none."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from specserve.cli import _knob_values, _training_config, build_parser
from specserve.config import Knob, config_knobs
from specserve.prepare import default_model_dir
from specserve.training.configs import DumpConfig, HeadsConfig, TrainConfig
from specserve.training.regenerate import RegenerateConfig

COMMANDS = {"train-drafter": TrainConfig, "train-drafters": HeadsConfig, "dump-features": DumpConfig,
            "regenerate-data": RegenerateConfig}
REQUIRED = {"train-drafter": ["--algorithm", "eagle3", "--out", "o"], "train-drafters": ["--out", "o"],
            "dump-features": ["--out", "o"], "regenerate-data": ["--out", "o"]}
# the flags each command has always had: their names do not change
FLAGS = {
    "train-drafter": {"--algorithm", "--method", "--out", "--model-dir", "--data", "--init-from", "--num-conversations",
                      "--max-len", "--batch-size", "--epochs", "--ttt-steps", "--draft-vocab-size", "--lr",
                      "--checkpoint-every", "--max-minutes", "--num-threads", "--seed", "--features", "--holdout",
                      "--dtype", "--device"},
    "train-drafters": {"--corpus", "--generate-answer-tokens", "--prompts", "--out", "--archive-dir", "--model-dir",
                       "--algorithms", "--minutes", "--max-len", "--batch-tokens", "--holdout", "--lr", "--dtype",
                       "--device", "--seed"},
    "dump-features": {"--out", "--model-dir", "--data", "--num-conversations", "--max-len", "--batch-size",
                      "--shard-size", "--no-aux", "--dtype", "--device", "--num-threads", "--seed"},
    "regenerate-data": {"--out", "--model-dir", "--data", "--num-conversations", "--max-prompt-tokens",
                        "--max-new-tokens", "--batch-size", "--temperature", "--sampled-answers", "--max-minutes",
                        "--seed", "--dtype", "--device"},
}


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _parse(command: str, *argv: str) -> argparse.Namespace:
    return build_parser().parse_args([command, *REQUIRED[command], *argv])


def _other(k: Knob) -> tuple[list[str], Any]:
    """Flag arguments that set the knob's field to something other than its default, and that value."""
    if k.switch:
        return [k.flag], k.switch[1]
    if k.choices:
        value = next(c for c in k.choices if c != k.default)
        return [k.flag, value], value
    if k.type is tuple:
        return [k.flag, "eagle3,mtp"], ("eagle3", "mtp")
    if k.type in (int, float):
        value = k.type((k.default or 0) + 2)
        return [k.flag, str(value)], value
    return [k.flag, "/other"], "/other"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_is_a_knob_with_help_and_a_flag_or_a_reason_for_none(command):
    cls = COMMANDS[command]
    ks = config_knobs(cls)
    assert [k.field for k in ks] == [f.name for f in dataclasses.fields(cls)]
    assert all(k.help for k in ks)
    flags = {f for k in ks if not k.no_flag for f in k.flags}
    options = {o for a in _subparser(command)._actions for o in a.option_strings} - {"-h", "--help"}
    assert options == flags == FLAGS[command]


@pytest.mark.parametrize("command", COMMANDS)
def test_parsing_no_options_gives_the_config_defaults(command):
    ks = config_knobs(COMMANDS[command])
    values = _knob_values(_parse(command), ks)
    for k in ks:
        if k.no_flag or k.required:
            continue
        default = None if k.default is dataclasses.MISSING else k.default  # model_dir: the command fills it
        assert values[k.field] == default, k.field


@pytest.mark.parametrize("command", COMMANDS)
def test_the_command_builds_the_config_its_defaults_make(command):
    cls = COMMANDS[command]
    given = {"corpus": "c"} if cls is HeadsConfig else {}  # it needs a corpus or tokens to generate
    argv = [f for name, value in given.items() for f in (f"--{name}", value)]
    config = _training_config(cls, _parse(command, *argv))
    required = {k.field: k.from_edge(getattr(_parse(command), k.edge)) for k in config_knobs(cls) if k.required}
    assert config == cls(**required, **given, model_dir=str(default_model_dir()))


@pytest.mark.parametrize(("command", "k"), [(c, k) for c, cls in COMMANDS.items() for k in config_knobs(cls)
                                            if not k.no_flag and not k.required])
def test_each_flag_sets_its_field(command, k):
    argv, value = _other(k)
    values = _knob_values(_parse(command, *argv), config_knobs(COMMANDS[command]))
    assert values[k.field] == value
    assert values == _knob_values(_parse(command), config_knobs(COMMANDS[command])) | {k.field: value}


def test_older_names_and_switches_parse_as_before():
    tc = _training_config(TrainConfig, build_parser().parse_args(["train-drafter", "--method", "eagle2", "--out", "o"]))
    assert tc.algorithm == "eagle"
    hc = _training_config(HeadsConfig, _parse("train-drafters", "--corpus", "c", "--algorithms", "eagle2,mtp"))
    assert hc.algorithms == ("eagle", "mtp")
    assert _training_config(DumpConfig, _parse("dump-features", "--no-aux")).aux is False
    assert _training_config(RegenerateConfig, _parse("regenerate-data", "--sampled-answers")).sampled_answers is True
    with pytest.raises(SystemExit):  # a head method only
        build_parser().parse_args(["train-drafter", "--algorithm", "ngram", "--out", "o"])
