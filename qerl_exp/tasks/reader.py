"""Reading a task's rows through Hugging Face `datasets`: data files, `save_to_disk` folders, hub ids.

`read(source, split, key)` is the one entry point; every task that reads data (gsm8k, math,
dataset) reads through it. What a source is (`kind`):
- a file: `.jsonl` or `.json` (JSON lines, or one JSON array), `.csv` or `.parquet`, loaded with
  `datasets.load_dataset`; a file's one split is `train`;
- a folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`, loaded with
  `datasets.load_from_disk`; a lone `Dataset` is the split `train`;
- anything else that reads as `name` or `owner/name` (and is no local path: `name.ext`, or under
  a folder that exists here) is a hub dataset id: the hub is asked once up
  front (`qerl_exp.run.hub`); without it only the local cache is read, so that a data set that is not
  there fails in one line within seconds.

Every row comes with where it is, for messages: `line N` of a JSON-lines file (blank lines
counted), `row N` otherwise. A JSON-lines file that `datasets` cannot read is read line by line
instead, to name every line that is not a JSON object; `tasks.datasets.load_problems` reports those
together with the rows' own faults, in one line. `datasets` narrates its work with progress bars
and log lines: they are silenced while it reads, and a failure is reported here in one line.

`datasets` is imported where it is used: the tasks that generate their problems never load it.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from qerl_exp.run.hub import hub_reachable

SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
FILE, FOLDER, HUB = "file", "folder", "hub"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
SOURCES = "a JSONL, JSON, CSV or Parquet file, a save_to_disk folder, or a hub dataset id"


class RowError(ValueError):
    """What is wrong with one row; the loader adds where it is."""


@dataclass
class Table:
    """One split of a data source.

    Args:
        columns: the column names, in the source's order.
        rows: `(where, row)` per record (`line 3`, `row 3`); `row` is a `RowError` for a line of a
            JSON-lines file that is not a JSON object.
    """

    columns: list[str]
    rows: list[tuple[str, dict | RowError]]


def kind(source: str, key: str) -> str:
    """What `source` is: `file`, `folder` or `hub` (see the module doc).

    Args:
        source: the value of the config field `key`.
        key: the field, for messages (`task.path`).

    Raises:
        FileNotFoundError: a local path (absolute, relative with a folder or a data file's suffix)
            that does not exist.
        ValueError: a file of a kind `datasets` is not asked to read.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        return FOLDER
    if path.is_file():
        if path.suffix.lower() not in SUFFIXES:
            raise ValueError(f"{key}={source} is a {path.suffix or 'suffix-less'} file; give {SOURCES}")
        return FILE
    first = source.split("/", 1)[0]
    local = source.startswith(("/", ".", "~")) or path.suffix.lower() in SUFFIXES or not _HUB_ID.match(source) or \
        ("/" in source and Path(first).is_dir()) or ("/" not in source and path.suffix)
    if local:
        raise FileNotFoundError(f"{key}={source} does not exist: it is not a file or a folder here; give {SOURCES}")
    near = sorted(p.name for p in path.parent.glob(f"{glob.escape(path.name)}.*") if p.suffix.lower() in SUFFIXES)
    if near:  # a data file named without its suffix, which would be read as a hub id
        raise FileNotFoundError(f"{key}={source} is not a file here, and would be read as a hub dataset id; "
                                f"did you mean {key}={path.parent / near[0] if '/' in source else near[0]}?")
    return HUB


def missing(source: str, key: str) -> str | None:
    """The one-line reason a local source named by `key` is not there; None when it is, or is a hub id
    (or is there but of a kind `kind` refuses with its own line)."""
    try:
        kind(source, key)
    except FileNotFoundError as e:
        return str(e)
    except ValueError:
        return None
    return None


def digest(source: str, caches: bool = False) -> str | None:
    """16 hex digits of the SHA-256 of a local source's data (a folder: its data files' names and
    bytes, in order: `data_files`); None for a hub id (the hub names its own revisions).
    `caches`: a folder's every file, the cache files `datasets` writes beside its data included
    (as records made before they were told apart hold it)."""
    path = Path(source).expanduser()
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and (caches or not _cache_file(p))):
        h.update(str(file.relative_to(path)).encode() + b"\0" + file.read_bytes())
    return h.hexdigest()[:16]


def _cache_file(file: Path) -> bool:
    """Whether `file` in a `save_to_disk` folder is one that `datasets` writes later, beside the data:
    the result of a `.map` or `.filter` on the loaded data set (`cache-<fingerprint>.arrow`) or one
    such write cut short (`tmp...`). The data's own files are named by its `state.json`."""
    state = file.parent / "state.json"
    if file.name == "state.json" or not state.is_file():
        return False
    try:
        data = {f["filename"] for f in json.loads(state.read_text())["_data_files"]}
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return file.suffix == ".arrow" and file.name not in data or file.name.startswith("tmp")


def read(source: str, split: str, key: str, *, name: str | None = None) -> Table:
    """One split of a data source, as plain rows.

    Args:
        source: a file, a `save_to_disk` folder or a hub dataset id.
        split: the split to read; empty: the source's only one.
        key: the config field that named the source, for messages (`task.path`).
        name: a hub data set's configuration (`main` for openai/gsm8k).

    Returns:
        The split's columns and rows.

    Raises:
        FileNotFoundError, ValueError: one line naming `key` and what to change.
    """
    what = kind(source, key)
    import datasets

    path = Path(source).expanduser()
    online = what == HUB and hub_reachable()  # asked once: with no hub, the local cache alone
    with _quiet():
        try:
            if what == HUB:
                with _offline(not online):
                    loaded = datasets.load_dataset(source, name, split=split or None)
            elif what == FOLDER:
                loaded = datasets.load_from_disk(str(path))
            else:
                loaded = datasets.load_dataset(SUFFIXES[path.suffix.lower()], data_files=str(path))
        except Exception as e:  # noqa: BLE001 - datasets and pyarrow raise many types for a bad source
            if what == FILE and _json_lines(path):
                return _line_by_line(path, key, e)
            if what == HUB:
                where = "from the hub" if online else \
                    "(the hub is unreachable and it is not in the local datasets cache)"
                raise ValueError(f"{key}={source} could not be loaded {where}: {_cause(e)}; give {SOURCES} that is "
                                 "here") from None
            raise ValueError(f"{key}={source}: datasets cannot read it ({_cause(e)})") from None
    dataset = _split(loaded, split, key, source)
    try:
        rows = dataset.to_list()
    except UnicodeDecodeError as e:  # `datasets` keeps a text file's bytes as they are: a byte not UTF-8 fails here
        if what == FILE and _json_lines(path):
            return _line_by_line(path, key, e)
        raise ValueError(f"{key}={source}: {_not_utf8(path) if what == FILE else f'not UTF-8 text ({e.reason})'}; "
                         "save it as UTF-8") from None
    lines = _line_numbers(path) if what == FILE and _json_lines(path) else None
    where = [f"line {n}" for n in lines] if lines is not None and len(lines) == len(rows) else \
        [f"row {i}" for i in range(1, len(rows) + 1)]
    return Table(list(dataset.column_names), list(zip(where, rows)))


def _split(loaded, split: str, key: str, source: str):
    """The dataset of `split` in what `datasets` loaded (a lone `Dataset` is `train`)."""
    import datasets

    if isinstance(loaded, datasets.Dataset):
        if not split or split == "train" or loaded.split is not None and str(loaded.split) == split:
            return loaded
        loaded = {"train": loaded}
    names = list(loaded)
    if not split:
        if len(names) != 1:
            raise ValueError(f"{key}={source} has the splits {', '.join(names)}; "
                             "name the one to evaluate on with task.eval_split")
        return loaded[names[0]]
    if split not in loaded:
        raise ValueError(f"{key}={source} has no split {split!r}; it has: {', '.join(names)} "
                         "(task.split, task.eval_split)")
    return loaded[split]


def _json_lines(path: Path) -> bool:
    """A `.jsonl` file, or a `.json` one that is not one JSON array."""
    if path.suffix.lower() == ".jsonl":
        return True
    if path.suffix.lower() != ".json":
        return False
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return not head.startswith(b"[")


def _not_utf8(path: Path) -> str:
    """Where a text file stops being UTF-8: its first such line, and the byte."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"line {i} is not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})"
    return "not UTF-8 text"


def _line_numbers(path: Path) -> list[int]:
    """The numbers of a JSON-lines file's non-blank lines: row i of `datasets` is line `[i]`."""
    with open(path, "rb") as f:
        return [i for i, raw in enumerate(f, start=1) if raw.strip()]


def _line_by_line(path: Path, key: str, error: BaseException) -> Table:
    """A JSON-lines file `datasets` could not read, read one line at a time: every line that is not
    a JSON object is named; with none, `datasets`' own error is."""
    rows = list(_json_rows(path))
    if not any(isinstance(row, RowError) for _, row in rows):
        raise ValueError(f"{key}={path}: datasets cannot read it ({_cause(error)})") from None
    columns = list(dict.fromkeys(k for _, row in rows if isinstance(row, dict) for k in row))
    return Table(columns, rows)


def _json_rows(path: Path) -> Iterator[tuple[str, dict | RowError]]:
    """`(line N, row)` for each non-blank line; a `RowError` for one that is not a JSON object."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield f"line {i}", RowError(f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                            "save the file as UTF-8 (JSON text is)")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield f"line {i}", RowError(f"not valid JSON ({e.msg} at column {e.colno})" + _python_hint(line))
                continue
            yield f"line {i}", row if isinstance(row, dict) else RowError(f"not a JSON object but {type(row).__name__}")


def _python_hint(line: str) -> str:
    """What to do about a line that is a Python literal (`str(row)` of a dict) rather than JSON."""
    try:
        value = ast.literal_eval(line.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return ""
    if not isinstance(value, dict):
        return ""
    return "; it is a Python dict (str(row)), not JSON: write each row with json.dumps(row)"


def _cause(e: BaseException) -> str:
    """The first line of the innermost error behind `e` (pyarrow's, under datasets' generic one)."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@contextmanager
def _quiet() -> Iterator[None]:
    """`datasets` without its progress bars and log lines, restored afterwards."""
    import datasets
    from datasets.utils import logging as ds_logging

    level, bars = ds_logging.get_verbosity(), not datasets.are_progress_bars_disabled()
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


@contextmanager
def _offline(offline: bool) -> Iterator[None]:
    """The hub libraries in offline mode (their local caches only) inside the block, when `offline`."""
    import datasets
    import huggingface_hub.constants as hub_constants

    if not offline:
        yield
        return
    saved = hub_constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    hub_constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved
