"""A run's record, `config.json`: what it holds, how one written by an older version reads today,
and how another config differs from it.

`config.json` holds the resolved config (`config.as_dict`), the Hydra `choices`, the data-parallel
`world_size`, the `commit` that started the run (`source_commit`), the digests of the files the task
reads (`DATA_KEY`), of its reward functions' source files (`REWARDS_KEY`) and of the base model's
files (`BASE_KEY`). A rerun or `resume=` may change the
keys of `RESUMABLE_KEYS` only: they change where and how a run is logged, never what a step
computes. A record is compared after `current` has read it with today's schema, so fields added
since it was written take the values the run used (`qerl_exp.config.history`).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

from qerl_exp.config import as_dict, flatten, from_dict
from qerl_exp import __version__

# Config keys a rerun or `resume=` may change. Not `train.steps`: it sets the learning-rate and noise
# schedules of every step, so a run continued at another length would mix two schedules.
RESUMABLE_KEYS = ("tracker.mode", "tracker.completions_every", "checkpoint.every", "checkpoint.keep",
                  "run_dir", "resume", "model.cache_dir", "choices", "train.dist_timeout_s", "world_size", "commit")
MAY_CHANGE = "tracker.mode, tracker.completions_every, checkpoint.*, model.cache_dir, train.dist_timeout_s"
# The digests of the files the task reads (`tasks.file_digests`: its data, a chat template file): a
# file that changes under a run is a config change.
DATA_KEY = "task_sha256"
# The reward functions' source files and their digests (`tasks.source_files`): so is edited reward code.
REWARDS_KEY = "reward_files"
# The digest of the base model's files (`models.base_digest`): a base swapped under a run is too.
BASE_KEY = "base_sha256"
# Recorded from the run's first start on: a record made before a run recorded them has nothing to
# compare with, and gains them when the run continues.
DIGEST_KEYS = (DATA_KEY, REWARDS_KEY, BASE_KEY)
# The commit a copy of the tree was made from, where git would name another (a GPU machine's copy).
COMMIT_ENV = "QERL_COMMIT"


class RecordError(ValueError):
    """A `config.json` that cannot be read as a run's record; the message names the file."""


def source_commit() -> str:
    """The commit of the code that is running, as a run records it.

    Returns:
        The `QERL_COMMIT` environment variable when set (a copy of the tree whose own git data,
        if any, names another commit: a GPU machine's); else `git rev-parse HEAD` of the checkout
        holding this package, with `-dirty` when its tracked files differ from that commit; else
        (a copy of the tree without its git folder) the package's version, `v0.1.0`.
    """
    if os.environ.get(COMMIT_ENV, "").strip():
        return os.environ[COMMIT_ENV].strip()

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(Path(__file__).parent), *args], capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return f"v{__version__}"


def read_config(run_dir: str | Path) -> dict | None:
    """The run's saved `config.json`, or None when there is none.

    Raises:
        RecordError: the file is there but is not a JSON object (one line naming it).
    """
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise RecordError(f"{path} is not readable JSON ({type(e).__name__}: {str(e).splitlines()[0]}); "
                          "restore it from the run's .hydra/config.yaml or choose another run_dir") from None
    if not isinstance(saved, dict):
        raise RecordError(f"{path} holds a {type(saved).__name__}, not a run config; choose another run_dir")
    return saved


def is_run_record(saved: dict) -> bool:
    """Whether a `config.json` is a run's (and not, say, a model checkpoint's)."""
    return isinstance(saved.get("train"), dict) and isinstance(saved.get("model"), dict)


def run_holding(path: str | Path) -> Path | None:
    """The run directory `path` is or lies in, if any: a folder that another command's files
    would mix with."""
    for folder in (Path(path).resolve(), *Path(path).resolve().parents):
        try:
            if is_run_record(json.loads((folder / "config.json").read_text())):
                return folder
        except (OSError, ValueError, AttributeError):
            continue
    return None


def current(saved: dict, where: str | Path = "config.json") -> dict:
    """`saved` as today's schema reads it: its config through `config.from_dict` (fields it lacks
    take the values the run used; see `qerl_exp.config.history`), its other keys as they are.

    Raises:
        RecordError: it does not fit today's schema (one line naming `where`).
    """
    try:
        return {**saved, **as_dict(from_dict(saved))}
    except Exception as e:  # noqa: BLE001 - OmegaConf raises many types for a record that does not fit
        text = str(e).strip()
        raise RecordError(f"{where} does not fit this version's config schema ({text.splitlines()[0] if text else type(e).__name__}); "
                          "evaluate or resume it with the version that wrote it (its commit is in the file)") from None


def _resumable(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS)


def changes(saved: dict, new: dict, keys: set[str] | None = None) -> list[str]:
    """`key: old -> new` for each key (of `keys`, default all) where `new` differs from `saved`.

    Keys in `RESUMABLE_KEYS` are left out: they may change when a run is continued; so are the
    digests (`DIGEST_KEYS`) one side has not recorded.
    """
    saved = {k: v for k, v in saved.items() if k not in DIGEST_KEYS or k in new}
    new = {k: v for k, v in new.items() if k not in DIGEST_KEYS or k in saved}
    a, b = flatten(saved), flatten(new)
    keys = (set(a) | set(b)) if keys is None else keys
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(keys) if not _resumable(k) and a.get(k) != b.get(k)]


def with_changes(saved: dict, new: dict, keys: set[str]) -> dict:
    """`saved` with the values of `new` at `keys` (dotted), e.g. a resume's `tracker.mode=disabled`."""
    out, flat = copy.deepcopy(saved), flatten(new)
    for key in keys:
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = flat[key]
    return out


def resumable_keys(keys: set[str]) -> set[str]:
    """The keys of `keys` a resume takes from its command line (`with_changes`)."""
    return {k for k in keys if _resumable(k) and k.split(".")[0] not in ("run_dir", "resume", "choices")}
