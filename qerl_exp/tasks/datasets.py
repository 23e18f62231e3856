r"""`task=gsm8k` and `task=math`: problems read from a file (or, for GSM8K, the hub).

File formats, one problem per JSONL line or Parquet row:
- GSM8K: `question`, and `answer` = worked reasoning, then a last line `#### <number>`. The
  reasoning, stripped of the `<<48/2=24>>` calculator annotations, is the problem's `solution`
  (the embedded model's warm-up imitates it); the number is the reference answer.
- MATH-style: `problem` (or `question`), and `solution` whose last `\boxed{...}` is the answer, or
  an explicit `answer` field (BigMath style), which wins when both are present.

A bad line is never skipped silently: loading fails with one line that names every malformed line
(the first few, and how many more). Duplicate questions are dropped before splitting, so that no
held-out question is also a training question. The held-out split is fixed by the file's content
and `task.eval_size` alone, never by the run's seed.

This module imports only the standard library and numpy at import time: the optional readers
(`datasets`, `pyarrow`) are imported where they are used, so every task is available without them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import warnings
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from qerl_exp.config import TaskConfig
from qerl_exp.tasks.base import HELD_OUT, Problem, check_split
from qerl_exp.tasks.answer import last_boxed, parse_number
from qerl_exp.tasks.rewards import default_rewards

_SPLIT_SEED = 20_251_013  # fixed: the held-out split must not move with the run's seed
_MAX_EVAL_FRACTION = 0.25  # a split file keeps at least three quarters of it for training
_SHOWN_ERRORS = 5
_CALCULATOR = re.compile(r"<<[^<>]*>>")


class _RowError(ValueError):
    """What is wrong with one row; the loader adds where it is."""


def gsm8k_problem(row: dict) -> Problem:
    """One GSM8K record as a `Problem`.

    Args:
        row: a mapping with string fields `question` and `answer` (reasoning, then
            `#### <number>`).

    Returns:
        The problem; `answer` is the text after `####` and `solution` the reasoning before it,
        without calculator annotations.

    Raises:
        ValueError: a field is missing or empty, or the final answer is missing or not a number.
    """
    question, answer = _text(row, "question"), _text(row, "answer")
    reasoning, sep, final = answer.rpartition("####")
    final = final.strip()
    if not sep:
        raise _RowError("field 'answer' has no final line '#### <number>'")
    if parse_number(final) is None:
        raise _RowError(f"final answer {final!r} after '####' is not a number")
    solution = _CALCULATOR.sub("", reasoning).strip()
    return Problem(question=question.strip(), answer=final, solution=solution)


def math_problem(row: dict) -> Problem:
    r"""One MATH-style record as a `Problem`.

    Args:
        row: a mapping with `problem` (or `question`) and `answer`, or `solution` ending in a
            `\boxed{...}` answer.

    Returns:
        The problem; `solution` is the worked solution when the row has one.

    Raises:
        ValueError: no question, or no answer field and no `\boxed{}` in the solution.
    """
    question = _text(row, "problem" if "problem" in row else "question")
    solution = row.get("solution") or ""
    if not isinstance(solution, str):
        raise _RowError(f"field 'solution' must be a string, got {type(solution).__name__}")
    answer = row.get("answer")
    if answer is not None and not isinstance(answer, str):
        answer = str(answer)  # BigMath-style files sometimes store numbers
    if not answer or not answer.strip():
        answer = last_boxed(solution)
        if not answer:
            raise _RowError("no 'answer' field and no \\boxed{...} answer in 'solution'")
    return Problem(question=question.strip(), answer=answer.strip(), solution=solution.strip())


def _text(row: dict, key: str) -> str:
    if key not in row:
        raise _RowError(f"missing field {key!r} (fields: {', '.join(map(str, row)) or 'none'})")
    value = row[key]
    if not isinstance(value, str) or not value.strip():
        raise _RowError(f"field {key!r} must be a non-empty string")
    return value


def _rows(path: Path) -> Iterator[tuple[str, dict | _RowError]]:
    """`(where, row)` for each record; `row` is a `_RowError` for a line that is not a JSON object."""
    if path.suffix == ".parquet":
        for i, row in enumerate(_read_parquet(path), start=1):
            yield f"row {i}", row
        return
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield f"line {i}", _RowError(f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                             "is it a JSONL file?")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield f"line {i}", _RowError(f"not valid JSON ({e.msg} at column {e.colno})")
                continue
            yield f"line {i}", row if isinstance(row, dict) else _RowError(f"not a JSON object but {type(row).__name__}")


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs pyarrow (pip install pyarrow), or convert it to JSONL") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a file that is not Parquet
        raise ValueError(f"{path} is not a readable Parquet file ({str(e).strip().splitlines()[0]})") from None


def load_problems(path: str | Path, parse_row: Callable[[dict], Problem]) -> list[Problem]:
    """Every problem of a JSONL or Parquet file, or one error that names the bad lines.

    Args:
        path: a `.jsonl` (or `.json` lines) or `.parquet` file.
        parse_row: turns one record into a `Problem` (`gsm8k_problem`, `math_problem`).

    Returns:
        The problems, in file order.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: one line naming the malformed lines, e.g.
            `data.jsonl: 2 malformed lines: line 3: not valid JSON (...); line 7: missing field 'answer'`.

    Example:
        >>> problems = load_problems("tests/data/gsm8k_sample.jsonl", gsm8k_problem)
        >>> problems[0].answer
        '60'
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"task.path={str(path)!r} is not a file")
    problems, errors = [], []
    for where, row in _rows(path):
        try:
            if isinstance(row, _RowError):
                raise row
            problems.append(dataclasses.replace(parse_row(row), source=f"{path} {where}"))
        except _RowError as e:
            errors.append(f"{where}: {e}")
    if errors:
        shown = "; ".join(errors[:_SHOWN_ERRORS])
        more = f"; and {len(errors) - _SHOWN_ERRORS} more" if len(errors) > _SHOWN_ERRORS else ""
        raise ValueError(f"{path}: {len(errors)} malformed line{'s' * (len(errors) > 1)}: {shown}{more}")
    if not problems:
        raise ValueError(f"{path}: no problems in the file")
    return problems


def _unique(problems: list[Problem]) -> list[Problem]:
    seen: set[str] = set()
    out = []
    for p in problems:
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


def split(problems: list[Problem], eval_size: int, where: str = "the file") -> tuple[list[Problem], list[Problem]]:
    """Deterministic train/held-out split of one problem list.

    Args:
        problems: all problems (duplicates already removed).
        eval_size: held-out problems wanted; capped at a quarter of the list (with a warning) so
            that a small file still leaves most of it for training.
        where: the file, for the message when it is too small.

    Returns:
        `(train, held_out)`, disjoint, each in file order. The held-out set for a smaller
        `eval_size` is a subset of the one for a larger `eval_size`.
    """
    n = len(problems)
    n_eval = min(eval_size, int(n * _MAX_EVAL_FRACTION))
    if n_eval < 1 or n - n_eval < 1:
        raise ValueError(f"{where} holds {n} distinct problem{'s' * (n != 1)}, too few to hold any out for evaluation; "
                         "use a file with at least 4, or give the held-out ones in task.eval_path")
    if n_eval < eval_size:
        warnings.warn(f"task.eval_size={eval_size} is more than a quarter of the {n} problems; holding out {n_eval}")
    order = np.random.default_rng(_SPLIT_SEED).permutation(n)
    held = set(order[:n_eval].tolist())
    return [p for i, p in enumerate(problems) if i not in held], [p for i, p in enumerate(problems) if i in held]


def _subset(problems: list[Problem], size: int) -> list[Problem]:
    """The first `size` problems of a fixed shuffle (a whole test split when it is small enough)."""
    if size >= len(problems):
        return problems
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(problems))[:size]
    return [problems[i] for i in sorted(order.tolist())]


def _fingerprint(*parts: object) -> str:
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:16]


def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()


def file_digests(cfg: TaskConfig) -> dict[str, str]:
    """The sha256 (16 hex digits) of each data file the task reads, by field (`path`, `eval_path`);
    empty for a generated task."""
    return {key: _file_digest(p)[:16] for key, p in (("path", cfg.path), ("eval_path", cfg.eval_path)) if p}


class FileTask:
    """A task over a fixed list of problems: training draws from `train`, evaluation uses `held_out`.

    Args:
        name: the task name (`gsm8k`, `math`).
        cfg: the task config (rewards).
        train: training problems.
        held_out: evaluation problems, never drawn for training.
        fingerprint: a digest of the data and the split; equal fingerprints mean equal problems.
    """

    splits = (HELD_OUT,)

    def __init__(self, name: str, cfg: TaskConfig, train: list[Problem], held_out: list[Problem], fingerprint: str):
        self.name, self.cfg = name, cfg
        self.train, self.held_out, self.fingerprint = train, held_out, fingerprint
        self.rewards = default_rewards(cfg)

    def sample(self, n: int, rng: np.random.Generator) -> list[Problem]:
        # Without replacement when the batch fits, so one step never repeats a question.
        idx = rng.choice(len(self.train), size=n, replace=n > len(self.train))
        return [self.train[i] for i in idx]

    def eval_problems(self, split: str = HELD_OUT) -> list[Problem]:
        check_split(self, split)
        return self.held_out


def _from_files(name: str, cfg: TaskConfig, parse_row: Callable[[dict], Problem]) -> FileTask:
    problems = _unique(load_problems(cfg.path, parse_row))
    # `task.eval_path` (a separate held-out file, e.g. GSM8K's test split) once the schema has it.
    eval_path = getattr(cfg, "eval_path", "")
    if eval_path:
        train = problems
        questions = {p.question for p in train}
        held_out = _subset([p for p in _unique(load_problems(eval_path, parse_row)) if p.question not in questions], cfg.eval_size)
        digest = (_file_digest(cfg.path), _file_digest(eval_path))
    else:
        train, held_out = split(problems, cfg.eval_size, f"task.path={cfg.path}")
        digest = (_file_digest(cfg.path),)
    return FileTask(name, cfg, train, held_out, _fingerprint(name, *digest, len(held_out)))


def gsm8k_task(cfg: TaskConfig) -> FileTask:
    """`task=gsm8k`: `task.path` (JSONL or Parquet in GSM8K's format), else `openai/gsm8k` from the hub.

    From the hub, training uses the `train` split and evaluation a fixed subset of `test`.
    """
    if cfg.path:
        return _from_files("gsm8k", cfg, gsm8k_problem)
    try:
        import datasets
    except ImportError:
        raise ValueError(
            "task=gsm8k without task.path needs the `datasets` package and the hub (pip install datasets); "
            "or pass task.path=<a GSM8K-format JSONL or Parquet file>"
        ) from None
    try:
        data = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as e:  # noqa: BLE001 - offline, missing auth, ...: all mean "use task.path"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"could not load openai/gsm8k from the hub ({first}); pass task.path=<local GSM8K file>") from None
    rows = {s: [gsm8k_problem(r) for r in data[s]] for s in ("train", "test")}
    held_out = _subset(rows["test"], cfg.eval_size)
    return FileTask("gsm8k", cfg, _unique(rows["train"]), held_out, _fingerprint("gsm8k", "hub", len(held_out)))


def math_task(cfg: TaskConfig) -> FileTask:
    r"""`task=math`: `task.path`, a JSONL or Parquet file of problems with `\boxed{}` answers."""
    if not cfg.path:
        raise ValueError(
            "task=math needs task.path=<JSONL or Parquet with 'problem' and a 'solution' holding \\boxed{answer}, "
            "or an 'answer' field>"
        )
    return _from_files("math", cfg, math_problem)


TASKS: dict[str, Callable[[TaskConfig], FileTask]] = {"gsm8k": gsm8k_task, "math": math_task}
