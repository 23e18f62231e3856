"""The config schema's history: how a run record that an older version wrote reads today.

Runs outlive the code that started them: an unfinished run is continued, a finished one evaluated
and analysed, by later versions whose schema has gained, retired or retyped fields. A record (a
run's `config.json`, the config inside its checkpoints) is read through `upgrade` before anything
rebuilds a config from it (`config.from_dict`) or compares it with a rerun's (`rundir`):

- A key the record holds is read through `READ_AS[key]` when the table lists it: a function from
  the recorded value to the current keys and values it means. `{}` drops a key that sets nothing
  now; a renamed field maps to its new name; a retyped one to its new value (the function returns
  a value already of the new form unchanged, since records written since hold that form).
- A field the record lacks then takes the value the run used: `BEFORE[key]` when the table lists
  it, else the field's default today. So a new field needs an entry in `BEFORE` exactly when its
  default is not what the code did before the field existed (a kernel added behind a flag that is
  on by default: `BEFORE["train.new_kernel"] = False`, since older runs ran without it), or a
  function of the record where that depends on its other settings.

A retired key set on the command line or in a preset is refused with its `RETIRED` line, which names
what to set instead (`unknown_key_line`).

Adding, retiring or retyping a field: add its entry here, and a case to `tests/unit/rundir/test_rundir.py` that
a record without it (or with its old form) still resumes.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from qerl_exp.config.trl_names import did_you_mean

# What leaves a field to today's default in `BEFORE` (its value never mattered to that run).
TODAY = object()

# The value each listed field had, in effect, before it existed (see the module docstring): a value,
# or a function of the record giving it (or `TODAY`).
BEFORE: dict[str, Any] = {
    # data files: duplicate prompts were dropped, and each step's prompts drawn afresh
    "task.drop_duplicates": True,
    "task.sampler": "independent",
    # the adaptive controller's set point was in nats before it could be relative to step 0's
    # entropy; other schedules never read it
    "noise.target_relative": lambda record: False if record.get("noise", {}).get("schedule") == "adaptive" else TODAY,
}

# How a recorded key reads today: its recorded value -> the current keys and values it means.
READ_AS: dict[str, Callable[[Any], dict[str, Any]]] = {
    # compiled the learner; removed when the packed learner replaced it (it set nothing a step computes)
    "train.compile": lambda value: {},
    # the loss's aggregation, now TRL's loss types: GRPO's mean of sequence means, DAPO's token mean
    "algo.loss_agg": lambda value: {"algo.loss_type": {"sequence": "grpo", "token": "dapo"}.get(value, value)},
    # a boolean before it took TRL's group / batch / none
    "algo.scale_rewards": lambda value: {
        "algo.scale_rewards": ("group" if value else "none") if isinstance(value, bool) else value},
}

# Keys of earlier versions that set something now spelled otherwise: the command line or a preset
# that sets one is refused with its line.
RETIRED = {
    "algo.loss_agg": "algo.loss_agg is retired; set algo.loss_type: grpo (was sequence), dapo (was token), dr_grpo or bnpo",
    "algo.scale_rewards": "algo.scale_rewards takes group, batch or none now (the boolean's true was group, false none)",
}


def unknown_key_line(key: str) -> str:
    """The one line for a config key the schema does not have: its retirement notice, if it had one;
    for a name of TRL's, the key it is here (`trl_names`)."""
    if key in RETIRED:
        return RETIRED[key]
    hint = did_you_mean(key)
    if hint:
        return f"unknown config key '{key}'{hint} (docs/trl.md maps TRL's names)"
    return f"unknown config key '{key}'; check the spelling, or list the fields with --cfg job"


def _pop(tree: dict, key: str) -> tuple[bool, Any]:
    *parents, leaf = key.split(".")
    for part in parents:
        tree = tree.get(part)
        if not isinstance(tree, dict):
            return False, None
    return (True, tree.pop(leaf)) if leaf in tree else (False, None)


def _put(tree: dict, key: str, value: Any, replace: bool = True) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    if replace or leaf not in tree:
        tree[leaf] = value


def upgrade(record: dict, before: dict[str, Any] | None = None,
            read_as: dict[str, Callable[[Any], dict[str, Any]]] | None = None) -> dict:
    """A record as today's schema reads it (a copy; `record` is left as it is).

    Args:
        record: nested dicts, as `config.as_dict` wrote them (other keys pass through).
        before: the values fields had before they existed; default `BEFORE`.
        read_as: how recorded keys read today; default `READ_AS`.

    Returns:
        The record with each `read_as` key replaced by what it means now, and each `before` field
        it lacks added with that value. Fields in neither table are left for the schema's defaults.
    """
    before = BEFORE if before is None else before
    read_as = READ_AS if read_as is None else read_as
    out = copy.deepcopy(record)
    for key, meaning in read_as.items():
        found, value = _pop(out, key)
        if found:
            for new_key, new_value in meaning(value).items():
                _put(out, new_key, new_value)
    for key, value in before.items():
        value = value(out) if callable(value) else value
        if value is not TODAY:
            _put(out, key, value, replace=False)
    return out
