"""Config keys of earlier versions: the one line that refuses a retired key on the command line or
in a preset, and a saved config (`config.json`, a checkpoint's) read in today's keys, so that a
run started by an earlier version resumes, compares and evaluates as it ran."""

from __future__ import annotations

import dataclasses


# Keys of earlier versions that set something now spelled otherwise: a command line or preset that
# sets one is refused with its line; a saved config that holds one is read through `upgrade`.
RETIRED = {
    "algo.loss_agg": "algo.loss_agg is retired; set algo.loss_type: grpo (was sequence), dapo (was token), dr_grpo or bnpo",
    "algo.scale_rewards": "algo.scale_rewards takes group, batch or none now (the boolean's true was group, false none)",
}
_DROPPED = {("train", "compile")}  # saved by earlier versions, set nothing now: dropped on reading


def unknown_key_line(key: str) -> str:
    """The one line for a config key the schema does not have: its retirement notice, if it had one."""
    return RETIRED.get(key, f"unknown config key '{key}'; check the spelling, or list the fields with --cfg job")


def _fill(data: dict, schema: type) -> dict:
    """`data` with each field of `schema` it lacks at the schema's default."""
    out = dict(data)
    for f in dataclasses.fields(schema):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            if isinstance(out.get(f.name), dict):
                out[f.name] = _fill(out[f.name], type(default))
        elif f.name not in out:
            out[f.name] = default
    return out


def upgrade(saved: dict, schema: type) -> dict:
    """A saved run config (`config.json`, a checkpoint's) in today's keys, meaning what it meant
    when it was written: retired keys mapped to their successors (`algo.loss_agg` sequence -> grpo,
    token -> dapo; a boolean `algo.scale_rewards` true -> group, false -> none), dropped ones
    removed, fields added since filled in with their defaults, but an adaptive noise controller's
    set point stays in nats (`noise.target_relative` false). Keys outside the schema (`choices`,
    `commit`, ...) are kept as they are; `schema` is the root config class (`config.Config`)."""
    data = {k: ({kk: vv for kk, vv in v.items() if (k, kk) not in _DROPPED} if isinstance(v, dict) else v)
            for k, v in saved.items()}
    algo = data.get("algo")
    if isinstance(algo, dict):
        algo = data["algo"] = dict(algo)
        if "loss_agg" in algo:
            algo.setdefault("loss_type", {"sequence": "grpo", "token": "dapo"}.get(algo.pop("loss_agg")))
        if isinstance(algo.get("scale_rewards"), bool):
            algo["scale_rewards"] = "group" if algo["scale_rewards"] else "none"
    noise = data.get("noise")
    if isinstance(noise, dict) and noise.get("schedule") == "adaptive" and "target_relative" not in noise:
        data["noise"] = {**noise, "target_relative": False}
    return _fill(data, schema)
