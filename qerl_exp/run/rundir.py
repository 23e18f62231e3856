"""Run directories: one owner at a time, and nothing under a run that differs from what started it.

`claim(run_dir, config)` takes a run directory for this process, once per run: a new run, or the
continuation of an unfinished one. It refuses, changing nothing on disk:
- a finished run (`summary.json`): it is never overwritten;
- a directory another process holds (an OS file lock, `.lock`, held for the run's life and
  released by the kernel when the process dies);
- a rerun whose config differs from the run's record (`config.json`, read with today's schema:
  `record.current`) outside `record.RESUMABLE_KEYS`, or whose task data or base model files have
  changed since the run started (their digests), once the run has logged a step or written a
  checkpoint (`started`): a run that failed before its first step holds nothing of a config's, and
  the same command, fixed, takes its directory over;
- a directory that holds other runs, or a `config.json` that is not a run's.

A default run directory (named by Hydra from the time, the choices and the seed) is never taken
from another run: with `fresh=True` a name in use is passed over for the first free
`<name>-2`, `<name>-3`, ..., so that runs started in the same second each get their own.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
from pathlib import Path

from qerl_exp.config import flatten
from qerl_exp.run import record
from qerl_exp.run.files import write_atomic

LOCK_FILE = ".lock"
# How deep below a run_dir other runs are looked for (runs/<date>/<time>_..., sweep/trials/<trial>).
_RUNS_DEPTH = 4


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked; nothing in it was changed."""


class RunExistsError(RunDirError):
    """The run directory holds a finished run, which is never overwritten."""


class RunDirBusy(RunDirError):
    """Another process owns the run directory."""


class ConfigChangedError(RunDirError):
    """A rerun or resume asks for a config other than the one the run was started with."""


class _Taken(RunDirError):
    """A default run directory that another run has taken (`claim(fresh=True)` passes it over)."""


class RunDir:
    """A run directory owned by this process until `release` (or the process ends).

    Args:
        path: the run directory.
        record: the run's record it was claimed with (`claim`'s `config`).
        lock: the open lock file; its `flock` is the ownership. None on the ranks of a
            data-parallel run other than 0, which use rank 0's (`distributed.claim`).
    """

    def __init__(self, path: Path, record: dict, lock=None) -> None:
        self.path, self.record, self._lock = path, record, lock

    def release(self) -> None:
        """Give up the directory (closing the only descriptor drops the flock)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def saved_config(run_dir: str | Path) -> dict | None:
    """`record.read_config`, refused as a `RunDirError` (one line) when unreadable."""
    try:
        return record.read_config(run_dir)
    except record.RecordError as e:
        raise RunDirError(str(e)) from None


def other_runs(path: str | Path, skip: tuple[str, ...] = ()) -> Path | None:
    """A run directory below `path` (not `path` itself, nor in its subfolders `skip`), or None: a
    run_dir that holds other runs would make them parts of one run, and `python -m analysis` would
    then see one run there."""
    root = Path(path)
    if not root.is_dir() or (root / "config.json").exists():
        return None
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        if here != root and "config.json" in files:
            try:
                if record.is_run_record(json.loads((here / "config.json").read_text())):
                    return here
            except (OSError, ValueError):
                pass
        depth = len(here.relative_to(root).parts)
        dirs[:] = [] if depth >= _RUNS_DEPTH or "config.json" in files else sorted(
            d for d in dirs if not d.startswith(".") and not (here == root and d in skip))
    return None


def _lock(run_dir: Path, create: bool, shared: bool = False):
    """Open and flock `run_dir/.lock`; None when `create` is False and there is no lock file.
    `shared`: a check's lock, which only an owner's refuses (the ranks of one torchrun command
    check the same directory at once)."""
    path = run_dir / LOCK_FILE
    try:
        f = open(path, "r+" if not create else "a+")
    except FileNotFoundError:
        if create:
            raise
        return None
    try:
        fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "unknown"
        f.close()
        raise RunDirBusy(f"{run_dir} is in use by process {owner} (another run writes there); "
                         "wait for it to end or choose another run_dir") from None
    return f


def claim(run_dir: str | Path, config: dict, fresh: bool = False) -> RunDir:
    """Take `run_dir` for this process: a new run, or the continuation of an unfinished one.

    Args:
        run_dir: the run directory (created if needed).
        config: the run's record (`train.run_config`): written to `config.json` when new,
            compared with it when not.
        fresh: `run_dir` is a default name, not the user's: a name another run has taken (or
            holds) is passed over for the first free `<run_dir>-2`, `-3`, ...

    Returns:
        The owned `RunDir` (its `path` is the directory taken); release it (or use it as a
        context manager) when the run ends.

    Raises:
        RunExistsError: `run_dir` holds a finished run.
        RunDirBusy: another process owns `run_dir` (the message names its pid).
        ConfigChangedError: `config` differs from the saved one outside `RESUMABLE_KEYS`, or the
            task data or base files changed since the run started.
        RunDirError: `run_dir` is a file, holds other runs or a `config.json` that is not a run's,
            or its `config.json` is unreadable.
        OSError: the directory cannot be created or written (see `files.os_error_line`).
    """
    run_dir = Path(run_dir).absolute()
    if not fresh:
        return _take(run_dir, config, fresh=False)
    for n in itertools.count(1):
        path = run_dir if n == 1 else run_dir.with_name(f"{run_dir.name}-{n}")
        try:
            return _take(path, config, fresh=True)
        except (_Taken, RunDirBusy):
            continue
    raise AssertionError("unreachable")


def check(run_dir: str | Path, config: dict) -> None:
    """What `claim` would refuse, read-only: a command checks its run_dir before it starts."""
    run_dir = Path(run_dir).absolute()
    lock = _lock(run_dir, create=False, shared=True) if run_dir.is_dir() else None  # refused when a run owns it
    try:
        _check(run_dir, config, fresh=False)
    finally:
        if lock is not None:
            lock.close()


def _take(run_dir: Path, config: dict, fresh: bool) -> RunDir:
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run_dir={run_dir} is a file, not a directory; choose another run_dir")
    # Checks first, read-only; a refused run leaves no trace. They are repeated under the lock.
    lock = _lock(run_dir, create=False) if run_dir.is_dir() else None
    try:
        _check(run_dir, config, fresh)
        if lock is None:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = _lock(run_dir, create=True)
            _check(run_dir, config, fresh)
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        saved = saved_config(run_dir)
        # a resumed run keeps the choices and the commit it started with (`summary.json` gets the one that ends it)
        merged = config if saved is None or not started(run_dir) else \
            {**config, **{k: saved[k] for k in ("choices", "commit") if k in saved}}
        if merged != saved:
            write_atomic(run_dir / "config.json", json.dumps(merged, indent=2))
    except BaseException:
        if lock is not None:
            lock.close()
        raise
    return RunDir(run_dir, config, lock)


def _check(run_dir: Path, config: dict, fresh: bool) -> None:
    saved = saved_config(run_dir)
    if saved is None:
        held = other_runs(run_dir)
        if held is not None:
            raise RunDirError(f"run_dir={run_dir} holds other runs (e.g. {held}); give this run a folder of its own, "
                              f"e.g. run_dir={run_dir / 'new'}")
        return
    if not record.is_run_record(saved):
        raise RunDirError(f"{run_dir / 'config.json'} is not a run's record (a model's folder?); choose another run_dir")
    if fresh:
        raise _Taken(str(run_dir))
    if (run_dir / "summary.json").exists():
        steps = flatten(saved).get("train.steps")
        length = "" if steps in (None, flatten(config).get("train.steps")) else (
            f" of {steps} steps, and a run keeps its length (train.steps sets its learning-rate and noise schedules)")
        raise RunExistsError(f"{run_dir} holds a finished run{length}; choose another run_dir")
    if not started(run_dir):  # it failed before its first step: nothing in it is another config's
        return
    changes, listed = _changes(saved, run_dir / "config.json", config)
    if changes:
        raise ConfigChangedError(
            f"{run_dir} holds an unfinished run started with another config ({listed}); {_advice(changes, run_dir)}")


def started(run_dir: str | Path) -> bool:
    """Whether the run in `run_dir` has done anything a config shaped: logged a step (`metrics.jsonl`)
    or written a checkpoint or its final state."""
    run_dir = Path(run_dir)
    log = run_dir / "metrics.jsonl"
    return (log.is_file() and log.stat().st_size > 0) or (run_dir / "final").exists() or \
        any((run_dir / "checkpoints").glob("step_*"))


def _advice(changes: list[str], run_dir: Path, resuming: bool = False) -> str:
    """What to do about refused config changes; the keys people change on purpose get their reason."""
    if any(c.startswith("train.steps:") for c in changes):
        return ("a run keeps its length (train.steps sets the learning-rate and noise schedules of every step): "
                "rerun with its train.steps, or start a new run in another run_dir")
    if any(c.startswith(f"{record.DATA_KEY}.") for c in changes):
        return ("the task's data file changed since the run started (or its chat template file did): restore that file, "
                "or start a new run in another run_dir")
    if any(c.startswith(f"{record.REWARDS_KEY}.") for c in changes):
        return ("a reward function's code (its source file, or a module of its folder it imports) changed since the run "
                "started: restore that file, or start a new run in another run_dir")
    if any(c.startswith(f"{record.BASE_KEY}:") for c in changes):
        return ("the base model's files (model.name, model.gguf_file) changed since the run started: restore them, "
                "or start a new run in another run_dir")
    if resuming:
        return f"drop them, or start a new run in another run_dir (only {record.MAY_CHANGE} may change)"
    return (f"continue it with the settings it started with: python -m qerl_exp resume={run_dir}; or choose another "
            f"run_dir (only {record.MAY_CHANGE} may change)")


def resumed(run_dir: str | Path, saved: dict, new: dict, keys: set[str]) -> dict:
    """The config a `resume=` continues with: the saved one, read with today's schema, plus the
    overrides that may change.

    Args:
        run_dir: the run being resumed (for the message).
        saved: its `config.json`.
        new: the config composed from the command line.
        keys: the dotted keys the command line set (`cli.set_keys`).

    Raises:
        ConfigChangedError: an override changes a key outside `RESUMABLE_KEYS` (all are listed).
        RunDirError: `config.json` does not fit today's schema.
    """
    try:
        now = record.current(saved, Path(run_dir) / "config.json")
    except record.RecordError as e:
        raise RunDirError(str(e)) from None
    changes = record.changes(now, new, keys)
    if changes:
        raise ConfigChangedError(
            f"resume={run_dir} continues the run with its saved config, but the overrides change {'; '.join(changes)}; "
            f"{_advice(changes, Path(run_dir), resuming=True)}")
    return record.with_changes(now, new, record.resumable_keys(keys))


def check_checkpoint(path: Path, saved: dict | None, config: dict) -> None:
    """Refuse to continue from a checkpoint that a run with another config wrote.

    Args:
        path: the checkpoint directory (for the message).
        saved: the run config recorded in the checkpoint (None in checkpoints that record none).
        config: the config the run continues with.

    Raises:
        ConfigChangedError: they differ outside `RESUMABLE_KEYS`: `config.json` was replaced or edited.
    """
    if saved is None:
        return
    changes, listed = _changes(saved, path / "state.pt", config)
    if changes:
        raise ConfigChangedError(
            f"{path} was written under another config than {path.parent.parent / 'config.json'} now holds "
            f"({listed}): that file was edited or replaced; restore it, or start a new run in another run_dir")


def _changes(saved: dict, where: Path, config: dict) -> tuple[list[str], str]:
    """How `config` differs from the record `saved` (read from `where`, with today's schema), and
    the first six differences as one line."""
    try:
        now = record.current(saved, where)
    except record.RecordError as e:
        raise RunDirError(str(e)) from None
    changes = record.changes(now, config)
    return changes, "; ".join(changes[:6]) + ("; ..." if len(changes) > 6 else "")
