"""Config fields declared once with their edges: a dataclass field made with `knob()` carries a
`Knob` (help, choices, the CLI flag and config.pbtxt parameter it is known by); `config_knobs(cls)`
lists a config class's knobs, from which the CLI flags, the model parameters and their table are
generated. This module defines no configuration itself (`config` does).
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any


def shown(value: Any) -> str:
    """A value (a client's, perhaps) for an error message, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class Knob:
    """A config field's help and its edges: the CLI flag `--<edge>` and the config.pbtxt
    parameter `<edge>`, where `edge` is `name` or else the field's name.

    switch: the edges are an on/off switch (a flag without value, a true/false parameter) whose
    off and on give these field values. no_flag / no_param: why the knob is no CLI flag / no
    config.pbtxt parameter ("" = it is one). path: a relative path in config.pbtxt is resolved
    against the project root. required: a field without default whose flag must be given (else
    the command fills it). aliases: older names of the flag. parse: reads the flag's text (default:
    the field's type). A tuple field's edge is its items joined by commas. The last four
    attributes are the field's, filled in by `config_knobs()`.
    """

    help: str
    choices: tuple[str, ...] = ()
    name: str = ""
    switch: tuple[Any, Any] | None = None
    path: bool = False
    no_flag: str = ""
    no_param: str = ""
    required: bool = False
    aliases: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None
    field: str = ""
    default: Any = None  # MISSING: a required field
    type: type = str  # tuple: a tuple of strings
    optional: bool = False  # None is a value: the edges' empty

    @property
    def edge(self) -> str:
        return self.name or self.field

    @property
    def flag(self) -> str:
        return "--" + self.edge.replace("_", "-")

    @property
    def flags(self) -> tuple[str, ...]:
        """The flag and its older names."""
        return (self.flag, *("--" + a.replace("_", "-") for a in self.aliases))

    def from_edge(self, value: Any) -> Any:
        """The field's value for a value at the edge (a switch's bool, a tuple's comma-separated items)."""
        if self.switch:
            return self.switch[bool(value)]
        return tuple(value.split(",")) if self.type is tuple and isinstance(value, str) else value

    def to_edge(self, value: Any) -> Any:
        """The edge's value for a field value (a switch: whether it is on; a tuple: its items joined by commas)."""
        if self.switch:
            return value == self.switch[1]
        return ",".join(value) if self.type is tuple and isinstance(value, tuple) else value


def knob(default: Any = MISSING, **kw: Any) -> Any:
    """A dataclass field declared with its `Knob` (keyword arguments)."""
    return field(default=default, metadata={"knob": Knob(**kw)})


def check_choices(config: Any) -> None:
    """Every knob with choices holds one of them."""
    for f in fields(config):
        choices, value = f.metadata["knob"].choices if "knob" in f.metadata else (), getattr(config, f.name)
        if choices and value not in choices:
            raise ValueError(f"{f.name}: must be one of {', '.join(choices)}, got {value!r}")


def knob_of(cls: type, f: Any) -> Knob:
    hint = typing.get_type_hints(cls)[f.name]
    kinds = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    kind = next(k for k in kinds if k is not type(None))
    return replace(f.metadata["knob"], field=f.name, default=f.default, optional=type(None) in kinds,
                   type=typing.get_origin(kind) or kind)


@functools.cache
def config_knobs(cls: type) -> tuple[Knob, ...]:
    """The knobs of a config dataclass's fields, in order, their field's attributes filled in
    (every field must be declared with `knob()`)."""
    return tuple(knob_of(cls, f) for f in fields(cls))
