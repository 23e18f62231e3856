"""How a config group is declared: a dataclass validated in `__post_init__`, read-only afterwards,
and the one-line errors its checks raise (`qerl_exp.config` holds the groups themselves)."""

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
