"""Python files of the user's (reward functions named `path/to/file.py:function`), imported as
modules of their own, each folder with its own neighbours.

A reward file may import the modules beside it (`import helper` for `helper.py` in its folder, or a
package there): its folder goes on `sys.path`, after the installed packages, so that a neighbour
named like a library (`datasets.py`) never hides it. Python keeps one module per name, so two reward
files in two folders that each import their own `helper.py` would share the first one imported.
Here each folder's neighbours are that folder's alone: while a file of folder F is imported, or one
of its functions runs (`scope`), `sys.modules` holds F's own `helper` and F comes first among the
reward folders on `sys.path`; another folder's `helper` is set aside meanwhile and put back after.

A file's neighbours are part of its code: `digests(file)` names each module its folder's files
imported from there (`imports`), with its digest, so that an edited helper is a change of the
reward code as an edited reward file is.

Importing runs the file's top level, which is the user's code: its `sys.argv` is the file alone (a
module-level `argparse` then reads no harness overrides), and a `SystemExit` it raises, or that a
library raises for it, is an error saying so (`UserExit`), with what it printed last.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

# A file's module, by (path, mtime, size): imported once per version of the file in a process.
_MODULES: dict[tuple[str, int, int], ModuleType] = {}
# Each reward folder's own neighbour modules (and their submodules), by name.
_NEIGHBOURS: dict[Path, dict[str, ModuleType]] = {}
_PREFIX = "qerl_reward_"


class UserExit(RuntimeError):
    """User code raised `SystemExit` (`sys.exit`, argparse, a library's exit); the message says so."""


def exit_line(e: SystemExit, said: str = "") -> str:
    """What a `SystemExit` of user code says: its code, and the last line the code printed."""
    last = next((line.strip() for line in reversed(said.splitlines()) if line.strip()), "")
    return f"SystemExit({e.code!r}): it called sys.exit (or a library did for it)" + (f"; it printed: {last}" if last else "")


def import_file(path: Path) -> ModuleType:
    """`path` imported as a module of its own, in its folder's `scope` (once per version of the file).

    Raises:
        UserExit: its top level raised `SystemExit` (one line: the code and what it printed last).
        Exception: whatever else its top level raised.
    """
    path = path.expanduser().resolve()
    stat = path.stat()
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key in _MODULES:
        return _MODULES[key]
    name = f"{_PREFIX}{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look a module up by its name
    err, out = io.StringIO(), io.StringIO()
    argv = sys.argv
    try:
        with scope(path), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            sys.argv = [str(path)]
            spec.loader.exec_module(module)
    except SystemExit as e:
        del sys.modules[name]
        raise UserExit(exit_line(e, err.getvalue() or out.getvalue())) from None
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.argv = argv
    sys.stdout.write(out.getvalue())  # what its top level printed, shown as it would have been
    sys.stderr.write(err.getvalue())
    _MODULES[key] = module
    return module


def _neighbour_names(folder: Path) -> set[str]:
    """The top-level module names `folder` provides: its `.py` files and its packages."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return set()
    return {p.stem for p in entries if p.suffix == ".py" and p.stem.isidentifier()} | \
        {p.name for p in entries if p.is_dir() and p.name.isidentifier() and (p / "__init__.py").is_file()}


def _top(name: str) -> str:
    return name.partition(".")[0]


def _from(module: ModuleType, folder: Path) -> bool:
    """Whether `module` was loaded from `folder`'s neighbour of its top-level name (`folder/top.py`
    or the package `folder/top/`)."""
    file = getattr(module, "__file__", None)
    if not file or not Path(file).resolve().is_relative_to(folder):
        return False
    top = _top(module.__name__)
    return Path(file).resolve().relative_to(folder).parts[0] in (f"{top}.py", top)


@contextlib.contextmanager
def scope(file: str | Path) -> Iterator[None]:
    """The module namespace of the reward file `file`'s folder F, for its import and its calls:
    F's own neighbour modules in `sys.modules`, another reward folder's of the same names set aside
    and put back on exit, and F first among the reward folders on `sys.path` (after the installed
    packages). The neighbours F's files newly import are kept as F's (`digests`)."""
    folder = Path(file).expanduser().resolve().parent
    names = _neighbour_names(folder)
    own = _NEIGHBOURS.setdefault(folder, {})
    others = {id(m) for f, mods in _NEIGHBOURS.items() if f != folder for m in mods.values()}
    aside = {n: m for n, m in sys.modules.items() if _top(n) in names and id(m) in others}
    for n in aside:
        del sys.modules[n]
    sys.modules.update({n: m for n, m in own.items() if n not in sys.modules})
    before = set(sys.modules)
    rest = [p for p in sys.path if p != str(folder)]
    first = next((i for i, p in enumerate(rest) if Path(p) in _NEIGHBOURS), len(rest))
    sys.path[:] = [*rest[:first], str(folder), *rest[first:]]
    try:
        yield
    finally:
        own.update({n: m for n, m in sys.modules.items() if _top(n) in names and (n in own or n not in before)
                    and _from(m, folder)})
        if aside:  # the other folder's modules come back in place of F's
            for n in [n for n in sys.modules if _top(n) in {_top(a) for a in aside}]:
                del sys.modules[n]
            sys.modules.update(aside)


def digests(file: str | Path) -> dict[str, str]:
    """The modules the reward files of `file`'s folder imported from it (their neighbours), each
    file's path in the folder and its sha256 (16 hex digits); empty when they imported none."""
    folder = Path(file).expanduser().resolve().parent
    me = Path(file).expanduser().resolve()
    out = {}
    for module in _NEIGHBOURS.get(folder, {}).values():
        path = Path(module.__file__).resolve()
        if path != me:
            out[path.relative_to(folder).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return dict(sorted(out.items()))
