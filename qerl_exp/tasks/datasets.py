r"""`task=gsm8k`, `task=math` and `task=dataset`: problems read from data (`task.path`) through
Hugging Face `datasets` (`tasks.reader`: files, `save_to_disk` folders, hub ids).

Row formats:
- GSM8K: `question`, and `answer` = worked reasoning, then a last line `#### <number>`. The
  reasoning, stripped of the `<<48/2=24>>` calculator annotations, is the problem's `solution`
  (the embedded model's warm-up imitates it); the number is the reference answer.
- MATH-style: `problem` (or `question`), and `solution` whose last `\boxed{...}` is the answer, or
  an explicit `answer` field (BigMath style), which wins when both are present.
- `dataset`, your own rows (docs/own_task.md): the prompt column (`task.columns.prompt`; `prompt`,
  else `question`) holds text (TRL's standard format) or a list of `{role, content}` messages (its
  conversational format, rendered by the chat template as it is); the answer column
  (`task.columns.answer`; `answer`, else `solution`) holds the reference answer.
Every other column of a row reaches the reward functions (`Problem.columns`), beside `answer`.

A bad row is never skipped silently: loading fails with one line that names every malformed line
or row (the first few, and how many more). A row whose prompt an earlier row has is kept, as TRL
keeps it (counted: `FileTask.facts`), or dropped with `task.drop_duplicates`; either way a held-out
prompt is never a training one. The held-out problems come from `task.eval_path` (its
`task.eval_split`, else its only split), else from `task.eval_split` of `task.path`, else from a
fixed slice of the training split (`task.split`; none with `task.eval_size=0`); the slice and the
subset taken from a larger held-out split are fixed by the data and `task.eval_size` alone, never by
the run's seed. Training draws its prompts epoch by epoch (`task.sampler=epoch`: each epoch a
shuffle of every training prompt, seeded by the run's seed and the epoch) or afresh each step
(`independent`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np

from qerl_exp.config.task import ColumnsConfig, TaskConfig
from qerl_exp.tasks import reader, reward_funcs
from qerl_exp.tasks.answer import last_boxed, parse_number
from qerl_exp.tasks.base import HELD_OUT, Problem, check_split
from qerl_exp.tasks.reader import RowError

_SPLIT_SEED = 20_251_013  # fixed: the held-out split must not move with the run's seed
_MAX_EVAL_FRACTION = 0.25  # a split file keeps at least three quarters of it for training
_SHOWN_ERRORS = 5
_CALCULATOR = re.compile(r"<<[^<>]*>>")
# Turns the rows of one table into problems: built from the table's columns and `key=source`.
Parser = Callable[[reader.Table, str], Callable[[dict], Problem]]


def gsm8k_problem(row: dict) -> Problem:
    """One GSM8K record as a `Problem`.

    Args:
        row: a mapping with string fields `question` and `answer` (reasoning, then
            `#### <number>`).

    Returns:
        The problem; `answer` is the text after `####` and `solution` the reasoning before it,
        without calculator annotations; any other field is one of its `columns`.

    Raises:
        ValueError: a field is missing or empty, or the final answer is missing or not a number.
    """
    question, answer = _text(row, "question"), _text(row, "answer")
    reasoning, sep, final = answer.rpartition("####")
    final = final.strip()
    if not sep:
        raise RowError("field 'answer' has no final line '#### <number>'")
    if parse_number(final) is None:
        raise RowError(f"final answer {final!r} after '####' is not a number")
    solution = _CALCULATOR.sub("", reasoning).strip()
    return Problem(question=question.strip(), answer=final, solution=solution, columns=_others(row, "question"))


def math_problem(row: dict) -> Problem:
    r"""One MATH-style record as a `Problem`.

    Args:
        row: a mapping with `problem` (or `question`) and `answer`, or `solution` ending in a
            `\boxed{...}` answer.

    Returns:
        The problem; `solution` is the worked solution when the row has one; any other field
        (e.g. `level`) is one of its `columns`.

    Raises:
        ValueError: no question, or no answer field and no `\boxed{}` in the solution.
    """
    key = "problem" if row.get("problem") is not None else "question"
    question = _text(row, key)
    solution = row.get("solution") or ""
    if not isinstance(solution, str):
        raise RowError(f"field 'solution' must be a string, got {type(solution).__name__}")
    answer = row.get("answer")
    if answer is not None and not isinstance(answer, str):
        answer = str(answer)  # BigMath-style files sometimes store numbers
    if not answer or not answer.strip():
        answer = last_boxed(solution)
        if not answer:
            raise RowError("no 'answer' field and no \\boxed{...} answer in 'solution'")
    return Problem(question=question.strip(), answer=answer.strip(), solution=solution.strip(),
                   columns=_others(row, "problem", "question"))


def _text(row: dict, key: str) -> str:
    if row.get(key) is None:  # `datasets` gives every row every column, None where a record lacks it
        present = [str(k) for k, v in row.items() if v is not None]
        raise RowError(f"missing field {key!r} (fields: {', '.join(present) or 'none'})")
    value = row[key]
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"field {key!r} must be a non-empty string")
    return value


def _others(row: dict, *prompt: str) -> dict[str, Any]:
    """A row's columns besides its prompt and `answer` (reward functions get the answer as text)."""
    return {k: v for k, v in row.items() if k not in (*prompt, "answer")}


def dataset_parser(columns: ColumnsConfig) -> Parser:
    """The row parser of `task=dataset` for `columns`: which columns hold the prompt and the
    answer, resolved once a table's columns are known (one `ValueError` line when they are not there)."""
    def make(table: reader.Table, where: str) -> Callable[[dict], Problem]:
        prompt = _column(columns.prompt, ("prompt", "question"), table.columns, "prompt", where)
        answer = _column(columns.answer, ("answer", "solution"), table.columns, "answer", where, optional=True)
        if answer is not None and answer == prompt:
            raise ValueError(f"task.columns.answer={answer} is the prompt's column of {where}: every row would be judged "
                             "against its own question; name the column that holds the answer")

        def parse(row: dict) -> Problem:
            question, messages = _prompt(row.get(prompt), prompt)
            if answer is None:  # prompt-only data: the reward functions need no reference
                return Problem(question=question, answer=None, messages=messages, columns=_others(row, prompt))
            value = row.get(answer)
            if value is None or isinstance(value, str) and not value.strip():
                raise RowError(f"column {answer!r} (the answer) is empty")
            text = value.strip() if isinstance(value, str) else \
                json.dumps(value) if isinstance(value, (list, dict)) else str(value)
            return Problem(question=question, answer=text, messages=messages, columns=_others(row, prompt))

        return parse

    return make


def _column(chosen: str, defaults: tuple[str, ...], columns: list[str], what: str, where: str,
            optional: bool = False) -> str | None:
    """The column that holds `what`: the chosen one, else the first of `defaults` the table has; None
    when it has none and `what` is `optional`."""
    if chosen:
        if chosen not in columns:
            raise ValueError(f"task.columns.{what}={chosen} is not a column of {where} (it has: {', '.join(columns)})")
        return chosen
    for name in defaults:
        if name in columns:
            return name
    if optional:
        return None
    raise ValueError(f"{where} has no {what} column ({' or '.join(defaults)}; it has: {', '.join(columns)}); "
                     f"name it with task.columns.{what}=<column>")


def _prompt(value, column: str) -> tuple[str, tuple[dict, ...]]:
    """`(question, messages)` of a prompt cell: text, or a list of `{role, content}` messages
    (their question is the last user message's content)."""
    if isinstance(value, str) and value.strip():
        return value.strip(), ()
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in value):
        # `datasets` gives every message every key of any message, None where it had none
        messages = tuple({k: v for k, v in m.items() if v is not None} for m in value)
        users = [m["content"] for m in messages if m["role"] == "user"]
        return (users or [messages[-1]["content"]])[-1], messages
    raise RowError(f"column {column!r} (the prompt) must be non-empty text or a list of {{role, content}} messages "
                   f"with text content, got {type(value).__name__}")


def _problems(table: reader.Table, parse_row: Callable[[dict], Problem], source: str) -> list[Problem]:
    """Every problem of `table`, or one error that names the bad lines or rows."""
    problems, errors = [], []
    for where, row in table.rows:
        try:
            if isinstance(row, RowError):
                raise row
            problems.append(dataclasses.replace(parse_row(row), source=f"{source} {where}"))
        except RowError as e:
            errors.append(f"{where}: {e}")
    if errors:
        shown = "; ".join(errors[:_SHOWN_ERRORS])
        more = f"; and {len(errors) - _SHOWN_ERRORS} more" if len(errors) > _SHOWN_ERRORS else ""
        noun = errors[0].split(" ", 1)[0]  # line or row
        raise ValueError(f"{source}: {len(errors)} malformed {noun}{'s' * (len(errors) > 1)}: {shown}{more}")
    if not problems:
        raise ValueError(f"{source}: no problems in it")
    return problems


def _load(source: str, split: str, key: str, parser: Parser, hub_name: str | None = None) -> list[Problem]:
    table = reader.read(source, split, key, name=hub_name)
    if table.rows and all(isinstance(row, RowError) for _, row in table.rows):  # no line read: its faults, not columns
        return _problems(table, lambda row: row, source)
    return _problems(table, parser(table, f"{key}={source}"), source)


def load_problems(path: str | Path, parse_row: Callable[[dict], Problem]) -> list[Problem]:
    """Every problem of a data file or folder (the `train` split), or one error that names the bad lines.

    Args:
        path: a JSONL, JSON, CSV or Parquet file, or a `save_to_disk` folder.
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
    return _load(str(path), "train", "task.path", lambda table, where: parse_row)


def _key(p: Problem) -> str:
    """What tells two prompts apart: the question, and a conversational prompt's messages."""
    return json.dumps([p.question, list(p.messages)], sort_keys=True, default=str)


def _unique(problems: list[Problem]) -> list[Problem]:
    seen: set[str] = set()
    out = []
    for p in problems:
        if _key(p) not in seen:
            seen.add(_key(p))
            out.append(p)
    return out


def split(problems: list[Problem], eval_size: int, where: str = "the file") -> tuple[list[Problem], list[Problem]]:
    """Deterministic train/held-out split of one problem list, by prompt: a prompt that several rows
    hold is held out (or trains) with all of them.

    Args:
        problems: all problems (duplicate prompts kept or removed).
        eval_size: distinct held-out prompts wanted; capped at a quarter of them (with a warning) so
            that a small file still leaves most of it for training; 0 holds none out.
        where: the file, for the message when it is too small.

    Returns:
        `(train, held_out)`, disjoint, each in file order. The held-out set for a smaller
        `eval_size` is a subset of the one for a larger `eval_size`.
    """
    if eval_size == 0:
        return list(problems), []
    distinct = _unique(problems)
    n = len(distinct)
    n_eval = min(eval_size, int(n * _MAX_EVAL_FRACTION))
    if n_eval < 1 or n - n_eval < 1:
        raise ValueError(f"{where} holds {n} distinct problem{'s' * (n != 1)}, too few to hold any out for evaluation; "
                         "use a file with at least 4, give the held-out ones in task.eval_path, or hold none out "
                         "(task.eval_size=0)")
    if n_eval < eval_size:
        warnings.warn(f"task.eval_size={eval_size} is more than a quarter of the {n} problems; holding out {n_eval}")
    order = np.random.default_rng(_SPLIT_SEED).permutation(n)
    held = {_key(distinct[i]) for i in order[:n_eval].tolist()}
    return [p for p in problems if _key(p) not in held], [p for p in distinct if _key(p) in held]


def _subset(problems: list[Problem], size: int) -> list[Problem]:
    """The first `size` problems of a fixed shuffle (a whole test split when it is small enough;
    all of them for size 0)."""
    if size == 0 or size >= len(problems):
        return problems
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(problems))[:size]
    return [problems[i] for i in sorted(order.tolist())]


def _fingerprint(*parts: object) -> str:
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:16]


def file_digests(cfg: TaskConfig, caches: bool = False) -> dict[str, str]:
    """The sha256 (16 hex digits) of each local file the task reads, by field: its data (`path`,
    `eval_path`; a folder's data files together: `reader.digest`, which takes `caches`) and a
    `chat_template` file. Empty for a generated task with the checkpoint's own template; a hub data
    set has none (the hub names its revisions)."""
    sources = (("path", cfg.path), ("eval_path", cfg.eval_path), ("chat_template", cfg.chat_template_file))
    digests = {key: reader.digest(value, caches) for key, value in sources if value}
    return {key: d for key, d in digests.items() if d is not None}


class FileTask:
    """A task over a fixed list of problems: training draws from `train`, evaluation uses `held_out`.

    Args:
        name: the task name (`gsm8k`, `math`, `dataset`).
        cfg: the task config (rewards, the sampler).
        train: training problems.
        held_out: evaluation problems, never drawn for training.
        fingerprint: a digest of the data and the split; equal fingerprints mean equal problems.
        duplicates: rows whose prompt an earlier row of the training data has (kept unless
            `task.drop_duplicates`).
        seed: the run's seed, which orders the epoch sampler's shuffles.
    """

    splits = (HELD_OUT,)

    def __init__(self, name: str, cfg: TaskConfig, train: list[Problem], held_out: list[Problem], fingerprint: str,
                 duplicates: int = 0, seed: int = 0):
        self.name, self.cfg, self.seed = name, cfg, seed
        self.train, self.held_out, self.fingerprint = train, held_out, fingerprint
        answered = any(p.answer is not None for p in train + held_out)  # prompt-only data has no answer column
        self.columns = (*(("answer",) if answered else ()), *dict.fromkeys(k for p in train + held_out for k in p.columns))
        self.conversational = any(p.messages for p in train + held_out)
        self.rewards = reward_funcs.load(cfg, self.columns)
        self.facts = {"data/train_prompts": len(train), "data/held_out_prompts": len(held_out),
                      "data/duplicate_prompts": duplicates}

    def sample(self, n: int, rng: np.random.Generator, start: int | None = None) -> list[Problem]:
        """`n` training problems: with `start` (the epoch sampler), those at positions `start`,
        `start + 1`, ... of the run's sequence of epochs, each epoch a shuffle of `train` seeded by
        the run's seed and the epoch (`rng` unused); without, drawn with `rng`."""
        if start is not None:
            size = len(self.train)
            epochs = {e: np.random.default_rng([self.seed, e]).permutation(size)
                      for e in range(start // size, (start + n - 1) // size + 1)}
            return [self.train[epochs[k // size][k % size]] for k in range(start, start + n)]
        # Without replacement when the batch fits, so one step never repeats a question.
        idx = rng.choice(len(self.train), size=n, replace=n > len(self.train))
        return [self.train[i] for i in idx]

    def epoch(self, drawn: int) -> float:
        """How many passes over the training prompts `drawn` problems make (TRL's fractional `epoch`)."""
        return drawn / len(self.train)

    def eval_problems(self, split: str = HELD_OUT) -> list[Problem]:
        check_split(self, split)
        return self.held_out


def duplicates_line(cfg: TaskConfig, task) -> str:
    """The line a run prints about the duplicate prompts of its data (empty when it has none)."""
    n = getattr(task, "facts", {}).get("data/duplicate_prompts", 0)
    if not n:
        return ""
    done = "dropped them (task.drop_duplicates=true)" if cfg.drop_duplicates else \
        "kept, as TRL keeps them (task.drop_duplicates=true drops them)"
    return f"task.path={cfg.path}: {n} row{'s' * (n > 1)} repeat an earlier row's prompt; {done}"


def _from_source(name: str, cfg: TaskConfig, parser: Parser, seed: int, source: str = "", hub_name: str | None = None,
                 default_eval_split: str = "") -> FileTask:
    """The task whose training problems are `task.split` of `source` (default `task.path`), and
    whose held-out ones come as the module doc says."""
    source = source or cfg.path
    rows = _load(source, cfg.split, "task.path", parser, hub_name)
    problems = _unique(rows)
    duplicates = len(rows) - len(problems)
    if not cfg.drop_duplicates:
        problems = rows
    eval_split = cfg.eval_split or ("" if cfg.eval_path else default_eval_split)
    if cfg.eval_path or eval_split:
        key, eval_source = ("task.eval_path", cfg.eval_path) if cfg.eval_path else ("task.path", source)
        seen = {_key(p) for p in problems}
        train = problems
        held_out = _subset([p for p in _unique(_load(eval_source, eval_split, key, parser, hub_name))
                            if _key(p) not in seen], cfg.eval_size)
        if not held_out:
            raise ValueError(f"{key}={eval_source} holds no problem that is not also a training problem; "
                             "hold out other problems, or leave task.eval_split and task.eval_path empty")
    else:
        train, held_out = split(problems, cfg.eval_size, f"task.path={cfg.path}")
        eval_source = source
    data = [reader.digest(s) or s for s in dict.fromkeys((source, eval_source))]
    kept = [f"duplicates kept: {duplicates}"] if duplicates and not cfg.drop_duplicates else []  # other training rows
    task = FileTask(name, cfg, train, held_out, _fingerprint(name, *data, cfg.split, eval_split, len(held_out), *kept),
                    duplicates=duplicates, seed=seed)
    if cfg.eval_path or eval_split:  # two tables: each gives the functions what they need (all rows together did)
        for rows, where in ((train, f"the training rows of task.path={source}"),
                            (held_out, f"the held-out rows of {key}={eval_source}")):
            reward_funcs.check_columns(task.rewards, ("answer", *dict.fromkeys(k for p in rows for k in p.columns)), where)
    return task


def gsm8k_task(cfg: TaskConfig, seed: int = 0) -> FileTask:
    """`task=gsm8k`: `task.path` (GSM8K's format), else `openai/gsm8k` from the hub.

    From the hub, training uses the `train` split and evaluation a fixed subset of `test`.
    """
    parser: Parser = lambda table, where: gsm8k_problem  # noqa: E731 - one row format for every table
    if cfg.path:
        return _from_source("gsm8k", cfg, parser, seed)
    try:
        return _from_source("gsm8k", cfg, parser, seed, source="openai/gsm8k", hub_name="main", default_eval_split="test")
    except (FileNotFoundError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"could not load openai/gsm8k from the hub ({first}); "
                         "pass task.path=<local GSM8K file>") from None


def math_task(cfg: TaskConfig, seed: int = 0) -> FileTask:
    r"""`task=math`: `task.path`, problems with `\boxed{}` answers or an `answer` field."""
    if not cfg.path:
        raise ValueError(
            "task=math needs task.path=<JSONL, JSON, CSV, Parquet or a save_to_disk folder with 'problem' and a "
            "'solution' holding \\boxed{answer}, or an 'answer' field>"
        )
    return _from_source("math", cfg, lambda table, where: math_problem, seed)


def dataset_task(cfg: TaskConfig, seed: int = 0) -> FileTask:
    """`task=dataset`: your own rows, read from `task.path` (docs/own_task.md)."""
    if not cfg.path:
        raise ValueError(f"task=dataset needs task.path=<{reader.SOURCES}>")
    return _from_source("dataset", cfg, dataset_parser(cfg.columns), seed)


TASKS: dict[str, Callable[[TaskConfig, int], FileTask]] = {"gsm8k": gsm8k_task, "math": math_task, "dataset": dataset_task}
