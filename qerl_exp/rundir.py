"""Run directories: one owner at a time, a config that cannot change under a run, whole files only.

- `claim(run_dir, config)` takes a run directory for this process: it refuses a finished run, a
  directory another process holds (an OS file lock, `.lock`, held for the run's life; released by
  the kernel when the process dies), and a rerun whose config differs from the saved
  `config.json` in anything but `RESUMABLE_KEYS`. A refusal changes nothing on disk.
- `write_atomic` writes a file through a temporary file and a rename, so a crash or a full disk
  leaves the old file or the new one, never half of one.
- `StopSignals` turns SIGINT and SIGTERM into a clean stop at the end of the current step (a
  second signal abandons the step); `Interrupted` carries the signal out of the run.
- `os_error_line` turns a full disk, a read-only path or a file standing where a directory belongs
  into one line that names the path and what to change.
- `source_commit` names the code a run ran: `config.json` records the commit that started it and
  keeps it when the run is resumed, `summary.json` the one that finished it.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

from qerl_exp.config import Config
from qerl_exp.retired import upgrade

LOCK_FILE = ".lock"
_UMASK = os.umask(0o022)
os.umask(_UMASK)
# Config keys a rerun or `resume=` may change: they change where and how a run is logged, never
# what a step computes. Not `train.steps`: it sets the learning-rate and noise schedules of every
# step, so a run continued at another length would mix two schedules under one config.json.
RESUMABLE_KEYS = ("tracker.mode", "tracker.completions_every", "checkpoint.every", "checkpoint.keep",
                  "run_dir", "resume", "model.cache_dir", "choices", "train.dist_timeout_s", "world_size", "commit")
_MAY_CHANGE = "tracker.mode, tracker.completions_every, checkpoint.*, model.cache_dir, train.dist_timeout_s"
# The `config.json` key of the digests of the files the task reads (`tasks.file_digests`: its data,
# a chat template file) and that of its reward functions' source files (`tasks.source_files`): a
# file that changes under a run is a config change.
DATA_KEY = "task_sha256"
REWARDS_KEY = "reward_files"
# The commit a copy of the tree was made from, where git would name another (a GPU machine's copy).
COMMIT_ENV = "QERL_COMMIT"


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked; nothing in it was changed."""


class RunExistsError(RunDirError):
    """The run directory holds a finished run, which is never overwritten."""


class RunDirBusy(RunDirError):
    """Another process owns the run directory."""


class ConfigChangedError(RunDirError):
    """A rerun or resume asks for a config other than the one the run was started with."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run.

    Args:
        signum: the signal.
        step: the step a resume starts at, when the run checkpointed it; None when the current
            step was abandoned (a resume starts at the last periodic checkpoint).
    """

    def __init__(self, signum: int, step: int | None = None) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.step = signum, step

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process ended by this signal


class StopSignals:
    """Catch SIGINT and SIGTERM while a run's steps execute.

    The first signal sets `signum`; the loop finishes its step, checkpoints and raises
    `Interrupted`. A second signal raises `Interrupted` at once. Only signals nobody else handles
    are taken (a sweep worker keeps its own handlers), and only in the main thread.
    """

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}
        defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, default in defaults.items():
            if signal.getsignal(sig) is default:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum:
            raise Interrupted(signum)
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def source_commit() -> str:
    """The commit of the code that is running, as a run records it.

    Returns:
        The `QERL_COMMIT` environment variable when set (a copy of the tree whose own git data,
        if any, names another commit: a GPU machine's); else `git rev-parse HEAD` of the checkout
        holding this package, with `-dirty` when its tracked files differ from that commit; else
        `unknown`.
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
        return "unknown"


def flatten(config: dict, prefix: str = "") -> dict:
    """Nested dicts to one level with dotted keys; lists stay values."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _resumable(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS)


def config_changes(saved: dict, new: dict, keys: set[str] | None = None) -> list[str]:
    """`key: old -> new` for each key (of `keys`, default all) where `new` differs from `saved`.

    Keys in `RESUMABLE_KEYS` are left out: they may change when a run is continued.
    """
    a, b = flatten(saved), flatten(new)
    keys = (set(a) | set(b)) if keys is None else keys
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(keys) if not _resumable(k) and a.get(k) != b.get(k)]


def with_changes(saved: dict, new: dict, keys: set[str]) -> dict:
    """`saved` with the values of `new` at `keys` (dotted), e.g. a resume's `train.steps=12`."""
    out, flat = copy.deepcopy(saved), flatten(new)
    for key in keys:
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = flat[key]
    return out


def resumed(run_dir: str | Path, saved: dict, new: dict, keys: set[str]) -> dict:
    """The config a `resume=` continues with: the saved one, plus the overrides that may change.

    Args:
        run_dir: the run being resumed (for the message).
        saved: its `config.json`.
        new: the config composed from the command line.
        keys: the dotted keys the command line set (`cli.set_keys`).

    Raises:
        ConfigChangedError: an override changes a key outside `RESUMABLE_KEYS` (all are listed).
    """
    changes = config_changes(saved, new, keys)
    if changes:
        raise ConfigChangedError(
            f"resume={run_dir} continues the run with its saved config, but the overrides change {'; '.join(changes)}; "
            f"{_advice(changes, 'drop them, or start a new run')}")
    return with_changes(saved, new, {k for k in keys if _resumable(k) and k.split(".")[0] not in ("run_dir", "resume", "choices")})


def read_config(run_dir: str | Path) -> dict | None:
    """The run's saved `config.json` in today's keys (`retired.upgrade`), or None when there is none.

    Raises:
        RunDirError: the file is there but is not a JSON object (one line naming it).
    """
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise RunDirError(f"{path} is not readable JSON ({type(e).__name__}: {str(e).splitlines()[0]}); "
                          "restore it from the run's .hydra/config.yaml or choose another run_dir") from None
    if not isinstance(saved, dict):
        raise RunDirError(f"{path} holds a {type(saved).__name__}, not a run config; choose another run_dir")
    return upgrade(saved, Config)  # in today's keys: a run started by an earlier version compares and resumes


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it and a rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the mode open() would
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:  # a failed write names no file; name ours
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


_CAUSES = {
    errno.ENOSPC: ("the disk is full", "free some space or choose a {key} on another disk"),
    errno.EDQUOT: ("the disk quota is used up", "free some space or choose a {key} on another disk"),
    errno.EFBIG: ("the file size limit is reached", "raise the limit (ulimit -f) or choose another {key}"),
    errno.EROFS: ("the file system is read-only", "choose a writable {key}"),
    errno.EACCES: ("permission denied", "choose a {key} you may write to"),
    errno.EPERM: ("permission denied", "choose a {key} you may write to"),
    errno.ENOTDIR: ("a file stands where a directory is needed", "remove that file or choose another {key}"),
    errno.EEXIST: ("a file stands where a directory is needed", "remove that file or choose another {key}"),
}


def as_os_error(e: BaseException | None) -> OSError | None:
    """The OS error behind `e`: itself, one it was raised from or while handling (torch's zip
    writer), or one a native library reported as text ("... (os error 28)", safetensors)."""
    while e is not None:
        if isinstance(e, OSError):
            return e
        found = re.search(r"\(os error (\d+)\)", str(e))
        if found:
            return OSError(int(found.group(1)), os.strerror(int(found.group(1))))
        e = e.__cause__ or e.__context__
    return None


def os_error_line(e: OSError, key: str = "run_dir") -> str | None:
    """One line for a storage fault (full disk, read-only path, file in the way); None for others.

    Args:
        e: the error.
        key: the setting that chose the path, named in what to change.
    """
    if e.errno not in _CAUSES:
        return None
    cause, fix = _CAUSES[e.errno]
    return f"cannot write {e.filename or 'the run directory'}: {cause}; {fix.format(key=key)}"


def check_writable(path: str | Path) -> None:
    """Raise the OSError that creating `path` (or writing into it) would meet, when its nearest
    existing folder is read-only, not ours to write, or a file: checked before any work."""
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
    if not os.access(existing, os.W_OK):
        code = errno.EROFS if os.statvfs(existing).f_flag & os.ST_RDONLY else errno.EACCES
        raise OSError(code, os.strerror(code), str(path))


class RunDir:
    """A run directory owned by this process until `release` (or the process ends).

    Args:
        path: the run directory.
        lock: the open lock file; its `flock` is the ownership.
    """

    def __init__(self, path: Path, lock) -> None:
        self.path, self._lock, self._claims = path, lock, 1

    def release(self) -> None:
        """Give up this claim; the lock goes with the last claim of the process."""
        self._claims -= 1
        if self._claims == 0:
            self._lock.close()  # closing the only descriptor drops the flock
            _HELD.pop(self.path, None)

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# Run directories this process owns: a second claim (the CLI, then `train.run`) shares the owner.
_HELD: dict[Path, RunDir] = {}


def _lock(run_dir: Path, create: bool):
    """Open and flock `run_dir/.lock`; None when `create` is False and there is no lock file."""
    path = run_dir / LOCK_FILE
    try:
        f = open(path, "r+" if not create else "a+")
    except FileNotFoundError:
        if create:
            raise
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "unknown"
        f.close()
        raise RunDirBusy(f"{run_dir} is in use by process {owner} (another run writes there); "
                         "wait for it to end or choose another run_dir") from None
    return f


def claim(run_dir: str | Path, config: dict) -> RunDir:
    """Take `run_dir` for this process: a new run, or the continuation of an unfinished one.

    Args:
        run_dir: the run directory (created if needed).
        config: the run's resolved config as nested dicts (with `choices`); written to
            `config.json` when new, compared with it when not.

    Returns:
        The owned `RunDir`; release it (or use it as a context manager) when the run ends.

    Raises:
        RunExistsError: `run_dir` holds a finished run.
        RunDirBusy: another process owns `run_dir` (the message names its pid).
        ConfigChangedError: `config` differs from the saved one outside `RESUMABLE_KEYS`.
        RunDirError: `run_dir` is a file, or its `config.json` is unreadable.
        OSError: the directory cannot be created or written (see `os_error_line`).
    """
    run_dir = Path(run_dir).absolute()
    if run_dir in _HELD:  # already ours (the CLI claims before `train.run` does)
        _check(run_dir, config)
        _HELD[run_dir]._claims += 1
        return _HELD[run_dir]
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run_dir={run_dir} is a file, not a directory; choose another run_dir")
    # Checks first, read-only; a refused run leaves no trace. They are repeated under the lock.
    lock = _lock(run_dir, create=False) if run_dir.is_dir() else None
    try:
        _check(run_dir, config)
        if lock is None:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = _lock(run_dir, create=True)
            _check(run_dir, config)
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        saved = read_config(run_dir)
        # a resumed run keeps the choices and the commit it started with (`summary.json` gets the one that ends it)
        merged = config if saved is None else {**config, **{k: saved[k] for k in ("choices", "commit") if k in saved}}
        if merged != saved:
            write_atomic(run_dir / "config.json", json.dumps(merged, indent=2))
    except BaseException:
        if lock is not None:
            lock.close()
        raise
    owned = _HELD[run_dir] = RunDir(run_dir, lock)
    return owned


def _advice(changes: list[str], default: str) -> str:
    """What to do about refused config changes; the keys people change on purpose get their reason."""
    if any(c.startswith("train.steps:") for c in changes):
        return ("a run keeps its length (train.steps sets the learning-rate and noise schedules of every step): "
                "rerun with its train.steps, or start a new run in another run_dir")
    if any(c.startswith(f"{DATA_KEY}.") for c in changes):
        return ("the task's data file changed since the run started (or its chat template file did): restore that file, "
                "or start a new run in another run_dir")
    if any(c.startswith(f"{REWARDS_KEY}.") for c in changes):
        return ("a reward function's source file changed since the run started: restore that file, or start a new run "
                "in another run_dir")
    return f"{default} (only {_MAY_CHANGE} may change)"


def _check(run_dir: Path, config: dict) -> None:
    saved = read_config(run_dir)
    if (run_dir / "summary.json").exists():
        steps = flatten(saved or {}).get("train.steps")
        length = "" if steps in (None, flatten(config).get("train.steps")) else (
            f" of {steps} steps, and a run keeps its length (train.steps sets its learning-rate and noise schedules)")
        raise RunExistsError(f"{run_dir} holds a finished run{length}; choose another run_dir")
    if saved is not None:
        if DATA_KEY not in saved:  # started before runs recorded their data: nothing to compare with
            config = {k: v for k, v in config.items() if k != DATA_KEY}
        changes = config_changes(saved, config)
        if changes:
            raise ConfigChangedError(
                f"{run_dir} holds an unfinished run started with another config ({'; '.join(changes[:6])}"
                f"{'; ...' if len(changes) > 6 else ''}); {_advice(changes, 'rerun with its settings, or choose another run_dir')}")


def check_checkpoint(path: Path, saved: dict | None, config: dict) -> None:
    """Refuse to continue from a checkpoint that a run with another config wrote.

    Args:
        path: the checkpoint directory (for the message).
        saved: the run config recorded in the checkpoint (None in checkpoints that record none).
        config: the config the run continues with.

    Raises:
        ConfigChangedError: they differ outside `RESUMABLE_KEYS`: `config.json` was replaced or edited.
    """
    changes = config_changes(upgrade(saved, Config), config) if saved is not None else []
    if changes:
        raise ConfigChangedError(
            f"{path} was written under another config than {path.parent.parent / 'config.json'} now holds "
            f"({'; '.join(changes[:6])}{'; ...' if len(changes) > 6 else ''}): that file was edited or replaced; "
            "restore it, or start a new run in another run_dir")
