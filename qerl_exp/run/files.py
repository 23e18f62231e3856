"""Whole files and storage faults: what every command that writes relies on.

- `write_atomic` writes a file through a temporary file and a rename, so a crash or a full disk
  leaves the old file or the new one, never half of one; `temp_dir` is the folder to do the same
  with a whole folder.
- `check_writable` finds, before any work, the fault that creating or writing a folder would meet.
- `os_error_line` turns a full disk, a read-only path or a file standing where a directory belongs
  into one line that names the path and the setting to change; `as_os_error` finds such a fault
  behind another library's exception.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from pathlib import Path


def _umask() -> int:
    """The process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode `open()` gives a new file under the current umask (mkstemp's files get 0600)."""
    return 0o666 & ~_umask()


def temp_dir(parent: str | Path, prefix: str) -> Path:
    """A new hidden folder in `parent` to write into and then rename into place, with the mode a
    folder made with `mkdir` gets (`tempfile.mkdtemp` makes it 0700, which the rename would keep)."""
    path = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
    os.chmod(path, 0o777 & ~_umask())
    return path


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it and a rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        os.fchmod(fd, file_mode())  # mkstemp makes 0600; give the file the mode open() would
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


def user_path(text: str) -> Path:
    """A path as typed on a command line, `~` expanded: shells expand none after `=` (`--out=~/x`),
    and a folder named `~` would be made instead."""
    return Path(text).expanduser()


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
