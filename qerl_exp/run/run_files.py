"""The files a run uses, as its record identifies them: the digests of its task's data (and chat
template file), of its reward functions' code and of its base model's files (`record.DIGEST_KEYS`).

Every command that loads a run checks them (a resume or rerun through `rundir`, `python -m
qerl_exp.eval`, `python -m qerl_exp.export`): a file changed since the run started would make it
another run. `digests(cfg)` computes them now; `comparable(saved, now)` computes them as an older
record did where the way changed (a checkpoint's chat templates were left out of its base, a
`save_to_disk` folder's cache files counted in its data, a reward file's imports were not followed,
paths were recorded as typed), so that such a record still compares, on the files themselves.
"""

from __future__ import annotations

import copy
import os

from qerl_exp.config import Config, from_dict
from qerl_exp.models.pretrained import base_digest
from qerl_exp.run.record import BASE_KEY, DATA_KEY, DIGEST_KEYS, REWARDS_KEY
from qerl_exp.tasks import file_digests, source_files


def digests(cfg: Config, keys: tuple[str, ...] = DIGEST_KEYS) -> dict:
    """The digests a run of `cfg` records (those of `keys` there are), computed now: of the files
    its task reads (`DATA_KEY`), of its reward functions' code, with the modules of their folders
    they import (`REWARDS_KEY`), and of its base's files, chat templates included (`BASE_KEY`).

    Raises:
        ConfigError: a reward function's file does not import (its imports are part of its digest).
    """
    compute = {DATA_KEY: lambda: file_digests(cfg.task), REWARDS_KEY: lambda: source_files(cfg.task),
               BASE_KEY: lambda: base_digest(cfg.model)}
    return {k: v for k in keys if (v := compute[k]())}


def comparable(saved: dict | None, now: dict) -> dict:
    """`now`, digests computed today (`digests`, or a record holding them), with those the record
    `saved` made another way made its way: a base digested without its chat templates, a data
    folder with its cache files, a reward file without its imports or under its path as typed.

    Returns:
        A copy of `now`; without `saved`, `now` as it is.
    """
    out = copy.deepcopy(now)
    if not saved:
        return out
    if BASE_KEY in saved and BASE_KEY in now and saved[BASE_KEY] != now[BASE_KEY]:
        if base_digest(from_dict(saved).model, templates=False) == saved[BASE_KEY]:
            out[BASE_KEY] = saved[BASE_KEY]
    data = saved.get(DATA_KEY) or {}
    if any(data.get(k) not in (None, v) for k, v in now.get(DATA_KEY, {}).items()):
        whole = file_digests(from_dict(saved).task, caches=True)
        out[DATA_KEY] = {k: data[k] if whole.get(k) == data.get(k) else v for k, v in now[DATA_KEY].items()}
    for name, entry in (saved.get(REWARDS_KEY) or {}).items():
        mine = out.get(REWARDS_KEY, {}).get(name)
        if not isinstance(entry, dict) or not isinstance(mine, dict):
            continue
        if "imports" not in entry:
            mine.pop("imports", None)
        typed = str(entry.get("file"))
        if typed != mine.get("file") and os.path.abspath(os.path.expanduser(typed)) == mine.get("file"):
            mine["file"] = typed
    return out
