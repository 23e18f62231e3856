"""How a config schema is made: a dataclass validated by its `__post_init__` and read-only after,
and the one-line `ConfigError` its checks raise. `qerl_exp.config` (the run's groups) and
`qerl_exp.task_config` (the task group) are written with it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class ConfigError(ValueError):
    """A config value that cannot work; the message says which field and what to change."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def choice(name: str, value: str, valid: list[str] | tuple[str, ...]) -> None:
    check(value in valid, f"{name}={value!r} is not valid; choose one of: {', '.join(valid)}")


def schema(cls):
    """A config dataclass whose fields are read-only once `__post_init__` has validated them (as
    verl's BaseConfig): vary a config with `dataclasses.replace`, which validates the new one."""
    cls = dataclass(cls)
    validate = cls.__dict__.get("__post_init__")

    def __post_init__(self) -> None:
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
