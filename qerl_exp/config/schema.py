"""What a config schema is: a dataclass validated once, then read-only, whose errors are one line.

`@schema` makes a config dataclass (`qerl_exp.config` holds the groups, `qerl_exp.config.task` the
task group): its `__post_init__` checks
that every float field is finite (nan and inf are refused for every field alike, before the
field's own range checks; an optional one may be None), runs the class's own checks, and freezes the instance. `check` and
`choice` raise `ConfigError` with a message that names the field and what to change.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

_SCHEMAS: list[type] = []


class ConfigError(ValueError):
    """A config value that cannot work; the message says which field and what to change."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def choice(name: str, value: str, valid: list[str] | tuple[str, ...]) -> None:
    check(value in valid, f"{name}={value!r} is not valid; choose one of: {', '.join(valid)}")


def place(cls: type) -> str:
    """The dotted place of a schema's fields in the root schema (`AlgoConfig` -> `algo.`): the
    schemas no other schema holds are roots, and the first path to `cls` names it."""
    hints = {s: typing.get_type_hints(s) for s in _SCHEMAS}
    nested = {t for h in hints.values() for t in h.values() if dataclasses.is_dataclass(t)}
    todo = [(s, "") for s in _SCHEMAS if s not in nested]
    while todo:
        current, prefix = todo.pop(0)
        if current is cls:
            return prefix
        todo += [(t, f"{prefix}{name}.") for name, t in hints.get(current, {}).items() if dataclasses.is_dataclass(t)]
    return ""


def schema(cls):
    """A config dataclass whose fields are read-only once `__post_init__` has validated them (as
    verl's BaseConfig): vary a config with `dataclasses.replace`, which validates the new one."""
    cls = dataclass(cls)
    _SCHEMAS.append(cls)
    validate = cls.__dict__.get("__post_init__")
    # float fields, and whether None is allowed (a field resolved from others when unset)
    floats = {f.name: f.type == "float | None" for f in dataclasses.fields(cls) if f.type in ("float", float, "float | None")}

    def __post_init__(self) -> None:
        for name, optional in floats.items():
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)) and not (optional and value is None):
                raise ConfigError(f"{place(cls)}{name} must be a finite number, got {value}")
        if validate is not None:
            validate(self)
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name, value) -> None:
        if getattr(self, "_frozen", False):
            raise dataclasses.FrozenInstanceError(
                f"{type(self).__name__}.{name} is read-only; make a new config with dataclasses.replace")
        object.__setattr__(self, name, value)

    cls.__post_init__, cls.__setattr__ = __post_init__, __setattr__
    return cls
