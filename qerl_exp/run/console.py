"""What every command does at the console: its streams survive a reader that goes away
(`tolerate_closed_pipes`), and an expected fault ends it in one `error:` line and a non-zero exit
(`fail`, `one_line_errors`, `one_line_argparse`); `key=value` arguments read as typed values
(`key_values`, `require`), a bad one named in a `UsageError`.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from qerl_exp.config.schema import ConfigError
from qerl_exp.run.files import os_error_line


class UsageError(ValueError):
    """Bad input from the command line or a spec file; the message is the whole report."""



def require(ok: bool, message: str) -> None:
    """Raise `UsageError(message)` unless `ok`: a command's argument checks."""
    if not ok:
        raise UsageError(message)


def key_values(argv: list[str], types: dict[str, str]) -> dict[str, object]:
    """`key=value` arguments of a command (`python -m qerl_exp.eval`, `.export`) as typed values.

    Args:
        argv: the arguments.
        types: each key's type, as a dataclass field names it: `str`, `int`, `float` or `bool`.

    Raises:
        UsageError: one line naming the argument that is not key=value, not a key, or not of its type.
    """
    values = {}
    for arg in argv:
        key, sep, raw = arg.partition("=")
        if not sep:
            raise UsageError(f"argument {arg!r} is not key=value; keys: {', '.join(types)}")
        if key not in types:
            raise UsageError(f"unknown argument {key!r}; keys: {', '.join(types)}")
        kind = types[key]
        try:
            if kind == "bool":
                if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                values[key] = raw.lower() in ("true", "1", "yes")
            else:
                values[key] = {"int": int, "float": float, "str": str}[kind](raw)
        except ValueError:
            raise UsageError(f"bad value for {key!r}: {raw!r} is not {'an' if kind == 'int' else 'a'} {kind}") from None
    return values


class _Unread:
    """A console stream whose reader may go away (`| head -1`): from then on it writes to /dev/null,
    so that a run does not fail for want of an audience (a BrokenPipeError at any print)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._stream.fileno())  # what is still buffered goes there too
        os.close(null)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def tolerate_closed_pipes() -> None:
    """Make stdout and stderr survive a reader that exits early; every command calls it first."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Unread):
            setattr(sys, name, _Unread(stream))


def one_line_argparse(parser):
    """`parser` (argparse) whose errors end in one `error:` line, exit status 2 (argparse prints its
    usage before the error)."""
    def error(message: str) -> None:
        fail(f"{message}; see {parser.prog} --help")

    parser.error = error
    return parser


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def first_line(e: BaseException) -> str:
    """An exception's message's first line (its type's name when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@contextmanager
def one_line_errors(path_key: str, interrupted: str):
    """A command's expected faults as one `error:` line and a non-zero exit: Ctrl-C (130, saying
    `interrupted`; a `signals.Interrupted` SIGTERM 143), a storage fault naming `path_key`, the
    setting that chose the path, or any ValueError or RuntimeError (1)."""
    try:
        yield
    except KeyboardInterrupt as e:
        fail(interrupted, code=getattr(e, "exit_code", 130))
    except OSError as e:
        fail(os_error_line(e, path_key) or f"{type(e).__name__}: {first_line(e)}", code=1)
    except ConfigError as e:  # what the run's data or model cannot serve, said in its own line
        fail(first_line(e), code=1)
    except (ValueError, RuntimeError) as e:
        fail(f"{type(e).__name__}: {first_line(e)}", code=1)
