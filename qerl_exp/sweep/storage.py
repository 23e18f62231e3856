"""A study's storage: its URL, opening it, and the claim lock every worker takes to claim a trial.

A lock that another program holds on a SQLite storage (an sqlite3 shell, a database browser), or
a claim lock that a stopped or hung worker holds, is reported within `LOCKED_REPORT_S` seconds,
and SIGINT/SIGTERM are heeded while waiting for either: the waits are in Python, since SQLite
waits for its locks in C, where no signal handler runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import sqlite3
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

from qerl_exp.run.console import UsageError
from qerl_exp.sweep.spec import Plan

# A lock (SQLite's, or the claim lock) held this long is another program's or a stopped worker's.
LOCKED_REPORT_S = 10.0
# SQLite's own wait for a lock, in C: short, so that a signal is handled soon after.
BUSY_TIMEOUT_S = 20.0


def quiet_optuna() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message=".*Heartbeat of storage is supposed to be used with Study.optimize.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")


# ---------------------------------------------------------------------------------------------
# Storage


def expand_sqlite(url: str, key: str = "storage") -> str:
    """A SQLite URL whose path starts with `~` (`sqlite:///~/study.db`) with the home folder put in,
    as the shell would for a path: SQLite itself would make a folder named `~` in the current one.

    Raises:
        UsageError: the path holds `$`, a variable the shell left unexpanded (in quotes).
    """
    found = re.match(r"(sqlite(?:\+\w+)?:///)(.*)", url)
    if not found:
        return url
    prefix, path = found.groups()
    if "$" in path:
        raise UsageError(f"{key}={url}: its path holds '$', a variable the shell did not expand (it was quoted); "
                         "write the path out")
    return prefix + str(Path(path).expanduser()) if path.startswith("~") else url


def storage_url(plan: Plan) -> str:
    """The storage URL with a driver SQLAlchemy can load (`postgresql://` means psycopg 3 here), a
    SQLite path's `~` expanded."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    expanded = expand_sqlite(plan.storage)
    try:
        url = make_url(expanded)
    except (ArgumentError, ValueError):
        raise UsageError(f"storage={plan.storage!r} is not a URL; use sqlite:///PATH or postgresql://USER@HOST:PORT/DB") from None
    backend = url.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise UsageError(f"storage={shown(plan.storage)}: use sqlite:///PATH (one machine) or postgresql://... (several)")
    if backend == "sqlite" and url.database in (None, "", ":memory:"):
        raise UsageError("storage=sqlite:// needs a file (workers are separate processes): sqlite:///PATH/study.db")
    if backend == "postgresql" and url.get_driver_name() == "psycopg2":
        try:
            import psycopg2  # noqa: F401
        except ImportError:
            url = url.set(drivername="postgresql+psycopg")
    if backend == "postgresql" and url.get_driver_name() == "psycopg":
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise UsageError(f"storage={shown(plan.storage)} needs the PostgreSQL driver psycopg, which is not installed: "
                             "pip install 'qerl-exp[postgres]' (or pip install 'psycopg[binary]')") from None
    return url.render_as_string(hide_password=False)


def shown(url: str) -> str:
    """A URL safe to print (password hidden)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001
        return url


def open_storage(plan: Plan) -> RDBStorage:
    """Connect to the plan's storage with heartbeats and retries of dead trials.

    Raises:
        UsageError: the storage cannot be reached or opened (one line).
    """
    quiet_optuna()
    url = storage_url(plan)
    engine_kwargs: dict = {"pool_pre_ping": True}
    if url.startswith("sqlite"):
        path = Path(url.split("///", 1)[1])
        path.parent.mkdir(parents=True, exist_ok=True)
        _wait_unlocked(path)
        # SQLite waits for a lock in C, where no signal is handled: keep each wait short. A study's own
        # transactions hold it for milliseconds.
        engine_kwargs = {"connect_args": {"timeout": BUSY_TIMEOUT_S}}
    else:
        engine_kwargs["connect_args"] = {"connect_timeout": 10}
    for attempt in range(5):
        try:
            # Several processes may open a fresh storage at once: creating its tables is serialized
            # by the claim lock, and a creation that still collides is retried.
            with claim_lock(plan):
                return RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=plan.heartbeat_interval,
                                  grace_period=plan.grace_period,
                                  heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=plan.max_retry))
        except Exception as e:  # noqa: BLE001 - drivers raise many types; all mean "cannot open"
            if "already exists" in str(e) and attempt < 4:
                time.sleep(0.5 + attempt)
                continue
            raise UsageError(f"cannot open storage {shown(plan.storage)}: {first_line(e)}") from None


def _wait_unlocked(path: Path) -> None:
    """Wait, in Python (so that signals are heeded), until no other program holds the SQLite file
    locked (an sqlite3 shell, a DB browser, a copy in progress).

    Raises:
        UsageError: still locked after `LOCKED_REPORT_S` seconds (one line naming the file).
    """
    if not path.is_file():
        return
    end = time.monotonic() + LOCKED_REPORT_S
    conn = sqlite3.connect(path, timeout=0)
    try:
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")  # the lock a write needs; released at once
                conn.rollback()
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) and "busy" not in str(e):
                    return  # not a lock: RDBStorage reports it
                if time.monotonic() > end:
                    raise UsageError(f"storage {path} has been locked by another program for {LOCKED_REPORT_S:g} s "
                                     "(an sqlite3 shell or a database browser with an open transaction?); "
                                     "close it and rerun") from None
            time.sleep(0.2)
    finally:
        conn.close()


def first_line(e: BaseException) -> str:
    cause = getattr(e, "orig", None) or e
    text = str(cause).strip()
    return text.splitlines()[0] if text else type(cause).__name__


@contextmanager
def claim_lock(plan: Plan, stop: Callable[[], bool] = lambda: False):
    """Serializes 'count the trials, then ask for one' across every worker of the study.

    Args:
        plan: the sweep.
        stop: polled while waiting for the lock; once true, the wait ends in KeyboardInterrupt
            (a worker's SIGINT/SIGTERM, which its handler only records).
    """
    url = storage_url(plan)
    if url.startswith("sqlite"):
        path = Path(url.split("///", 1)[1] + ".lock")
        with open(path, "a+") as f:  # the holder's pid inside, for whoever waits
            def holder() -> str:
                f.seek(0)
                return f"process {f.read().strip() or '?'} (lock file {path})"

            _acquire(lambda: _try_flock(f), holder, stop)  # released by the kernel if the process dies
            try:
                f.truncate(0)
                f.write(str(os.getpid()))
                f.flush()
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return
    import sqlalchemy

    key = int.from_bytes(hashlib.sha1(f"qerl_exp.sweep:{plan.study_name}".encode()).digest()[:8], "big", signed=True)
    engine = _pg_engine(url)
    with engine.connect() as conn:  # a dead worker's connection closes and frees the lock
        def try_lock() -> bool:
            taken = conn.execute(sqlalchemy.text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar()
            conn.commit()
            return bool(taken)

        _acquire(try_lock, lambda: f"another worker (PostgreSQL advisory lock {key} in {shown(plan.storage)})", stop)
        try:
            yield
        finally:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
            conn.commit()


def _try_flock(f) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _acquire(try_lock: Callable[[], bool], holder: Callable[[], str], stop: Callable[[], bool]) -> None:
    """Poll `try_lock` until it succeeds. A claim holds the lock for milliseconds, so a wait of
    `LOCKED_REPORT_S` means a stopped or hung holder: said once, naming it."""
    start, said = time.monotonic(), False
    while not try_lock():
        if stop():
            raise KeyboardInterrupt
        if not said and time.monotonic() - start > LOCKED_REPORT_S:
            print(f"waiting for the study's claim lock, held by {holder()} for {LOCKED_REPORT_S:g} s: "
                  "a stopped or hung worker? (end it, and its trial is retried)", file=sys.stderr, flush=True)
            said = True
        time.sleep(0.05)


_ENGINES: dict = {}


def _pg_engine(url: str):
    import sqlalchemy

    if url not in _ENGINES:
        _ENGINES[url] = sqlalchemy.create_engine(url, pool_size=1, max_overflow=0, pool_pre_ping=True,
                                                 connect_args={"connect_timeout": 10})
    return _ENGINES[url]
