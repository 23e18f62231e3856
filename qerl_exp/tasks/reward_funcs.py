"""The run's reward functions (`task.reward_funcs`): loaded, checked, called and weighed.

A reward function has TRL's batched signature, `fn(prompts, completions, **kwargs) -> list[float | None]`,
and is called once for a batch of completions, with keyword arguments, as TRL's GRPOTrainer calls it:
- `prompts`: each completion's prompt: its text, or its list of `{role, content}` messages;
- `completions`: each completion: its text, or `[{"role": "assistant", "content": text}]` where its
  prompt is conversational;
- `completion_ids`: each completion's token ids, up to and including its EOS (a list of ints);
- `trainer_state`: a `transformers.TrainerState` of the step: `global_step` (the updates done before
  this batch), `max_steps` (`train.steps`) and `epoch` (the passes over the training prompts drawn
  before this batch; a generated task's is `global_step / max_steps`);
- `log_extra(column, values)`: adds a column, one value per completion, to the step's rows of
  `completions.jsonl` (under `extra`) and of the W&B table;
- `log_metric(name, value)`: logs a number as `rewards/<function>/<name>` (the mean of the values
  logged in the step);
- one keyword list per column of the problems' rows: `answer` (the reference answer, as text; none
  for a prompt-only data set) and every column of the data beside the prompt (e.g. `difficulty`);
- the keyword arguments `task.reward_kwargs.<function>` gives it, the same on every call.
A function names what it reads and takes the rest with `**kwargs`; one without `**kwargs` gets, of
`completion_ids`, `trainer_state`, `log_extra` and `log_metric`, only those it names. An `async def`
function is awaited, all of a batch's together (`asyncio.gather`), as TRL does. It returns one value
per completion: a number, or None where it does not apply (a code reward on a math row).

Where a function comes from (the name it is logged by is what follows the colon):
- `format`, `correct`: the built-in ones (`qerl_exp.tasks.rewards`), with task.format_reward and
  task.correct_reward as their amounts;
- `path/to/file.py:function`: a function of a Python file, relative to the working directory (the
  config records it resolved); the file is imported as a module of its own, and it may import its
  neighbours, each folder its own (`qerl_exp.tasks.user_code`);
- `package.module:function`: a function of an importable module.

A completion's reward is the weighted sum of the values that apply (`task.reward_weights`, 1 each).
One that no function applies to (every value None) has no reward: as in TRL, it is left out of its
group's mean and std and of the logged `reward`, and its advantage is 0; the run warns once. The
values are logged unweighted, per function: `rewards/<name>/mean` and `/std` (`qerl_exp.rl.metrics`).

Each function's source file is recorded in `config.json` (`reward_files`: its path and sha256, and
the neighbour modules its folder's files import, `imports`: their paths in that folder and sha256s),
so that a run is neither resumed nor evaluated with reward code other than its own.

Faults, each in one line that names the function: one that does not import, is a class or a
generator, whose signature cannot take `prompts` and `completions` by keyword, that needs a column
the data lacks, that lacks `**kwargs` for the columns it does not name, or that does not take an
argument its `task.reward_kwargs` gives, is refused when the task is built (`load`; before any run
directory, in `cli.preflight`). One that raises, returns another number of values than
completions, a value that is neither a finite number nor None, or values whose weighted sum is
beyond float32 (the dtype the rewards are summed and normalized in) stops the run (`RewardError`,
naming the step); so does a `SystemExit` from it or a library it calls; its checkpoints stay as
they were.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from qerl_exp.config.schema import ConfigError
from qerl_exp.config.task import BUILTIN_REWARDS, TaskConfig
from qerl_exp.tasks import user_code
from qerl_exp.tasks.rewards import builtin, default_names

# The function whose positive value counts a completion correct (evaluation's pass@k), and the one
# whose positive value counts it in format (`eval/format`).
JUDGE, FORMAT = "correct", "format"
# What every function gets besides the columns; a data column of one of these names is refused.
_OWN = ("prompts", "completions")
# The largest reward float32 holds: rewards are summed, normalized and logged in float32.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
# TRL's other arguments, given to a function that takes them (by name or **kwargs).
_TRL = ("completion_ids", "trainer_state", "log_extra", "log_metric")


class RewardError(RuntimeError):
    """A reward function failed on a batch; the message names it, the step and what to change."""


@dataclass(frozen=True)
class RewardFunc:
    """One reward function of a run.

    Args:
        name: its name in logs (`rewards/<name>/mean`): what follows the colon of its spec.
        spec: the `task.reward_funcs` entry it was loaded from.
        fn: the function.
        weight: its weight in the sum.
        file: its source file ('' for a built-in one).
        kwargs: its own keyword arguments (`task.reward_kwargs.<name>`), passed on every call.
    """

    name: str
    spec: str
    fn: Callable
    weight: float
    file: str
    kwargs: dict = field(default_factory=dict)


def specs(cfg: TaskConfig) -> list[str]:
    """The run's `task.reward_funcs`, or the built-in defaults when it names none."""
    return list(cfg.reward_funcs) or default_names(cfg)


def source_file(spec: str) -> str:
    """The file `spec`'s function is defined in: the path as given for `file.py:function`, the
    module's file for `package.module:function`, '' for a built-in.

    Raises:
        ConfigError: the file does not exist, or the module cannot be found.
    """
    where = spec.rpartition(":")[0]
    if not where:
        return ""
    if where.endswith(".py"):
        if not Path(where).expanduser().is_file():
            raise ConfigError(f"task.reward_funcs entry {spec}: no file {where} "
                              "(paths are relative to the working directory)")
        return where
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"task.reward_funcs entry {spec}: module {where} does not import "
                          f"({_first_line(e)})") from None
    if found is None or not found.origin or not Path(found.origin).is_file():
        raise ConfigError(f"task.reward_funcs entry {spec}: no module {where} on the Python path; "
                          "give path/to/file.py:function, or install the package")
    return found.origin


def source_files(cfg: TaskConfig) -> dict[str, dict]:
    """What `config.json` records of each user function: `{name: {"file": ..., "sha256": 16 hex}}`,
    and for a `file.py:function` whose folder's files import neighbours of theirs, `"imports":
    {path in the folder: 16 hex}` (the files are imported to know them); empty for a run of
    built-in functions only.

    Raises:
        ConfigError: a function's file does not import (`load`).
    """
    out = {}
    for spec in specs(cfg):
        file = source_file(spec)
        if file:
            if spec.rpartition(":")[0].endswith(".py"):
                _import(spec)
            digest = hashlib.sha256(Path(file).expanduser().read_bytes()).hexdigest()[:16]
            imports = user_code.digests(file) if spec.rpartition(":")[0].endswith(".py") else {}
            out[spec.rpartition(":")[2]] = {"file": file, "sha256": digest, **({"imports": imports} if imports else {})}
    return out


def load(cfg: TaskConfig, columns: Sequence[str] | None = None,
         builtins: Callable[[str, TaskConfig], Callable] = builtin) -> Rewards:
    """The run's reward functions, imported and checked.

    Args:
        cfg: the task config (`reward_funcs`, `reward_weights`, the built-ins' amounts).
        columns: the keyword lists the task's rows give (`Task.columns`); None skips the checks
            that need them (a hub data set not read yet).
        builtins: what `format` and `correct` are for this task (`rewards.builtin`; a task whose
            replies are not in the paper's format gives its own, as `tasks.fork` does).

    Returns:
        The `Rewards`, in the order of `task.reward_funcs`.

    Raises:
        ConfigError: one line naming the function: not importable, not a function, a signature
            that cannot take `prompts`, `completions` and the columns.
    """
    weights = list(cfg.reward_weights) or [1.0] * len(specs(cfg))
    if columns is not None and "answer" not in columns and "correct" in specs(cfg):
        raise ConfigError("the built-in correct judges replies against the answer column, which the data lacks; "
                          "name your own reward functions in task.reward_funcs")
    funcs = []
    for spec, weight in zip(specs(cfg), weights):
        name = spec.rpartition(":")[2]
        fn = builtins(name, cfg) if spec in BUILTIN_REWARDS else _import(spec)
        func = RewardFunc(name, spec, fn, float(weight), source_file(spec), dict(cfg.reward_kwargs.get(name, {})))
        _check_kind(func)
        _check_signature(func, columns)
        funcs.append(func)
    return Rewards(funcs)


def trainer_state(step: int, steps: int, epoch: float):
    """The `transformers.TrainerState` reward functions get as `trainer_state`: `global_step` (updates
    done), `max_steps` (`train.steps`) and `epoch` (passes over the training prompts so far)."""
    from transformers import TrainerState  # a reward batch needs it; the config checks do not

    return TrainerState(global_step=step, max_steps=steps, epoch=epoch)


def _check_kind(func: RewardFunc) -> None:
    """Refuse what a batch call cannot use: a class (calling it makes an instance) or a generator."""
    where = f"task.reward_funcs entry {func.spec}"
    if inspect.isclass(func.fn):
        raise ConfigError(f"{where}: {func.name} is a class; name an instance of it (made in your file) or a function")
    if inspect.isgeneratorfunction(func.fn) or inspect.isasyncgenfunction(func.fn):
        raise ConfigError(f"{where}: {func.name} is a generator; return the list of rewards instead of yielding them")


def _is_async(fn: Callable) -> bool:
    """An `async def` function, or an object whose `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _import(spec: str) -> Callable:
    where, _, name = spec.rpartition(":")
    file = source_file(spec)
    try:
        module = user_code.import_file(Path(file)) if where.endswith(".py") else importlib.import_module(where)
    except (user_code.UserExit, SystemExit) as e:
        why = str(e) if isinstance(e, user_code.UserExit) else user_code.exit_line(e)
        raise ConfigError(f"task.reward_funcs entry {spec}: importing {file} ends the program ({why}); keep a "
                          "script's own argument parsing and exits under if __name__ == '__main__':") from None
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything while it runs
        raise ConfigError(f"task.reward_funcs entry {spec}: {file} does not import "
                          f"({type(e).__name__}: {_first_line(e)})") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"task.reward_funcs entry {spec}: {file} has no function {name!r}")
    if not callable(fn):
        raise ConfigError(f"task.reward_funcs entry {spec}: {name} is a {type(fn).__name__}, not a function")
    return fn


def _check_signature(func: RewardFunc, columns: Sequence[str] | None) -> None:
    """Refuse a function that cannot be called as `fn(prompts=..., completions=..., **columns)`."""
    try:
        params = inspect.signature(func.fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: its call will tell
        return
    kinds = inspect.Parameter
    takes_any = any(p.kind == kinds.VAR_KEYWORD for p in params.values())
    where = f"reward function {func.name} ({func.spec})"
    fix = "give it the signature fn(prompts, completions, **kwargs), as TRL's reward functions have"
    for p in params.values():
        if p.kind == kinds.POSITIONAL_ONLY and p.default is p.empty:
            raise ConfigError(f"{where} takes {p.name!r} by position only, but every argument is passed by "
                              f"keyword; {fix}")
    for own in _OWN:
        if own not in params and not takes_any:
            raise ConfigError(f"{where} does not take {own!r}; {fix}")
    for arg in func.kwargs:
        if arg in (*_OWN, *_TRL) or (columns is not None and arg in columns):
            raise ConfigError(f"task.reward_kwargs.{func.name}.{arg} is an argument the run passes itself; "
                              "give yours another name")
        if arg not in params and not takes_any:
            raise ConfigError(f"task.reward_kwargs.{func.name}.{arg}: {where} takes no argument {arg!r} "
                              f"(it takes: {', '.join(params)})")
    if columns is None:
        return
    clash = [c for c in columns if c in (*_OWN, *_TRL)]
    if clash:
        raise ConfigError(f"the data has a column named {clash[0]!r}, which reward functions get as their own "
                          "argument; rename that column")
    missing = [n for n in _required(func) if n not in columns]
    if missing:
        raise ConfigError(f"{where} needs {missing[0]!r}, which is not a column of the task's rows "
                          f"(they give: {', '.join(columns) or 'none'}) nor one of its task.reward_kwargs; "
                          "give it a default, read another column, or set task.reward_kwargs."
                          f"{func.name}.{missing[0]}")
    unnamed = [c for c in columns if c not in params]
    if unnamed and not takes_any:
        raise ConfigError(f"{where} does not take the column {unnamed[0]!r}, and every column is passed to it; "
                          "add **kwargs to its parameters")


def _scope(f: RewardFunc):
    """Where `f` runs: its file's folder's neighbour modules, for what it imports as it runs."""
    return user_code.scope(f.file) if f.spec.rpartition(":")[0].endswith(".py") else nullcontext()


def _fault(f: RewardFunc, e: Exception | SystemExit, where: str) -> RewardError:
    """The one line the run stops with when `f` raised `e`, or ended the program (`SystemExit`)."""
    if isinstance(e, SystemExit):
        return RewardError(f"reward function {f.name} ({f.spec}) ended the program at {where}: "
                           f"{user_code.exit_line(e)}; raise an exception instead")
    return RewardError(f"reward function {f.name} ({f.spec}) raised {type(e).__name__} at {where}: {_first_line(e)}")


def _required(func: RewardFunc) -> list[str]:
    """The columns `func` cannot run without: its parameters without a default, besides its own."""
    try:
        params = inspect.signature(func.fn).parameters
    except (TypeError, ValueError):
        return []
    kinds = inspect.Parameter
    return [n for n, p in params.items() if p.default is p.empty and n not in (*_OWN, *_TRL, *func.kwargs)
            and p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]


def check_columns(rewards: Rewards, columns: Sequence[str], rows: str) -> None:
    """Refuse a function that needs a column that some of the task's rows lack, e.g. the held-out
    rows of another file than the training rows (`load` checks the columns of all rows together).

    Args:
        rewards: the task's functions.
        columns: the keyword lists those rows give (`answer` and their columns).
        rows: which rows they are, for the message (e.g. `the held-out rows of task.eval_path=test.jsonl`).

    Raises:
        ConfigError: one line naming the function, the column and the rows.
    """
    for func in rewards.funcs:
        missing = [n for n in _required(func) if n not in columns]
        if missing:
            raise ConfigError(f"reward function {func.name} ({func.spec}) needs {missing[0]!r}, which {rows} lack (they "
                              f"give: {', '.join(columns)}); add that column there, or give the parameter a default")


class Rewards:
    """A run's reward functions, called on batches of completions.

    Args:
        funcs: the functions, in the order of `task.reward_funcs`.
    """

    def __init__(self, funcs: list[RewardFunc]):
        self.funcs = funcs
        self.names = [f.name for f in funcs]
        self.weights = {f.name: f.weight for f in funcs}
        self._warned = False
        # what the last `compute`'s functions logged: `log_extra` columns, and `log_metric` values by
        # metric name (`rewards/<function>/<name>`)
        self.extra: dict[str, list] = {}
        self.logged: dict[str, list[float]] = {}

    def compute(self, problems: Sequence, completions: list[str], where: str,
                names: Sequence[str] | None = None, completion_ids: list[list[int]] | None = None,
                state=None) -> dict[str, list[float]]:
        """Every function's value for each completion, unweighted; NaN where a function returned None.
        What the functions log (`log_extra`, `log_metric`) is in `extra` and `logged` afterwards.

        Args:
            problems: each completion's `tasks.Problem` (a group's problem repeated).
            completions: the completions' texts.
            where: what the batch is, for messages (e.g. `step 3`, `evaluation`).
            names: compute only these functions; None: all of them.
            completion_ids: each completion's token ids (through its EOS); None: not passed.
            state: the `transformers.TrainerState` functions get as `trainer_state` (`trainer_state`).

        Returns:
            `{name: [value per completion]}`, in the order of the functions.

        Raises:
            RewardError: a function raised, or returned another number of values or a value that
                is neither a finite number nor None, or logged a column of another length or a
                value that is not a finite number (one line naming it and `where`).
        """
        kwargs = {"prompts": [p.prompt for p in problems],
                  "completions": [[{"role": "assistant", "content": c}] if p.messages else c
                                  for p, c in zip(problems, completions)]}
        if any(p.answer is not None for p in problems):
            kwargs["answer"] = [p.answer for p in problems]
        keys = dict.fromkeys(k for p in problems for k in p.columns)
        kwargs.update({k: [p.columns.get(k) for p in problems] for k in keys})
        self.extra, self.logged = {}, {}
        calls = [f for f in self.funcs if names is None or f.name in names]
        args = {f.name: self._arguments(f, kwargs, completion_ids, state, len(completions), where) for f in calls}
        results = {f.name: self._call(f, args[f.name], where) for f in calls if not _is_async(f.fn)}
        waited = [f for f in calls if _is_async(f.fn)]
        if waited:
            results.update(zip([f.name for f in waited], self._await(waited, args, where)))
        out = {f.name: _values(f, results[f.name], len(completions), where) for f in calls}
        if names is None:
            self._check_sum(out, where)
            self._warn_unscored(out, where)
        return out

    def _arguments(self, f: RewardFunc, columns: dict, completion_ids, state, n: int, where: str) -> dict:
        """Function `f`'s keyword arguments: the batch's prompts, completions and columns (copies: a
        function that edits its arguments edits its own), TRL's others as far as it takes them, and
        its `task.reward_kwargs`."""
        def log_extra(column: str, values) -> None:
            values = list(values)
            if len(values) != n:
                raise RewardError(f"reward function {f.name} ({f.spec}) logged {len(values)} values of column "
                                  f"{column!r} for {n} completions at {where}; log one per completion")
            self.extra[str(column)] = values

        def log_metric(name: str, value) -> None:
            if not isinstance(value, numbers.Real) or not math.isfinite(value) or str(name) in ("mean", "std"):
                raise RewardError(f"reward function {f.name} ({f.spec}) logged {name!r}: {value!r} at {where}; "
                                  "log_metric takes a name other than mean and std, and a finite number")
            self.logged.setdefault(f"rewards/{f.name}/{name}", []).append(float(value))

        trl = {"completion_ids": copy.deepcopy(completion_ids), "trainer_state": state, "log_extra": log_extra,
               "log_metric": log_metric}
        return {**copy.deepcopy(columns), **{k: v for k, v in trl.items() if v is not None and _takes(f.fn, k)},
                **copy.deepcopy(f.kwargs)}

    @staticmethod
    def _call(f: RewardFunc, kwargs: dict, where: str):
        try:
            with _scope(f):
                return f.fn(**kwargs)
        except RewardError:
            raise  # log_extra or log_metric refusing what the function logged
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's code may raise anything
            raise _fault(f, e, where) from e

    @staticmethod
    def _await(funcs: list[RewardFunc], args: dict[str, dict], where: str) -> list:
        """The async functions' results, awaited together (TRL's `asyncio.gather`)."""
        async def one(f: RewardFunc):
            try:
                with _scope(f):
                    return await f.fn(**args[f.name])
            except RewardError:
                raise
            except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's code may raise anything
                raise _fault(f, e, where) from e

        async def together():
            return await asyncio.gather(*(one(f) for f in funcs))

        return asyncio.run(together())

    def verdicts(self, problems: Sequence, completions: list[str], where: str, name: str = JUDGE,
                 completion_ids: list[list[int]] | None = None, state=None) -> list[bool] | None:
        """Whether function `name` gives each completion a positive value; None when the run has no
        function of that name (the other arguments are `compute`'s)."""
        if name not in self.names:
            return None
        values = self.compute(problems, completions, where, names=[name], completion_ids=completion_ids, state=state)
        return [v > 0 for v in values[name]]

    def _check_sum(self, scores: dict[str, list[float]], where: str) -> None:
        """Refuse weighted values whose sum float32 cannot hold (`metrics.total_reward` sums them in it)."""
        total = np.zeros(len(next(iter(scores.values()))), dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            for name, v in scores.items():  # as `metrics.total_reward` sums them
                total = total + np.nan_to_num(np.asarray(v, dtype=np.float32)) * np.float32(self.weights[name])
        over = np.flatnonzero(~np.isfinite(total))
        if over.size:
            i = int(over[0])
            terms = " + ".join(f"{self.weights[name]:g} x {v[i]:g}" for name, v in scores.items() if not math.isnan(v[i]))
            raise RewardError(f"the weighted rewards of completion {i} at {where} ({terms}) sum beyond float32's range "
                              f"(+-{_FLOAT32_MAX:.3g}), in which rewards are summed and normalized; lower the values or "
                              "task.reward_weights")

    def _warn_unscored(self, scores: dict[str, list[float]], where: str) -> None:
        unscored = sum(all(math.isnan(v[i]) for v in scores.values()) for i in range(len(next(iter(scores.values())))))
        if unscored and not self._warned:
            self._warned = True
            print(f"warning: no reward function applies to {unscored} completion(s) at {where} (each returned None): "
                  "they get no reward and advantage 0, as in TRL (shown once)", file=sys.stderr)


def _takes(fn: Callable, name: str) -> bool:
    """Whether `fn` takes the keyword argument `name` (by name, or with **kwargs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: give it everything, as TRL does
        return True
    return name in params or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


def _values(f: RewardFunc, values, n: int, where: str) -> list[float]:
    """A function's return value as floats (NaN for None), or a `RewardError` saying what is wrong."""
    what = f"reward function {f.name} ({f.spec})"
    fix = "return one value per completion: a finite number, or None where the function does not apply"
    try:
        values = list(values)
    except TypeError:
        raise RewardError(f"{what} returned a {type(values).__name__} at {where}, not a list; {fix}") from None
    if len(values) != n:
        raise RewardError(f"{what} returned {len(values)} values for {n} completions at {where}; {fix}")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
            continue
        try:
            x = float(v) if isinstance(v, numbers.Real) else math.nan
        except OverflowError:  # an int beyond every float
            x = math.inf
        if not math.isfinite(x) and not (isinstance(v, numbers.Integral) and x == math.inf):
            raise RewardError(f"{what} returned {v!r} for completion {i} at {where}; {fix}")
        if abs(x) > _FLOAT32_MAX:
            raise RewardError(f"{what} returned {v!r:.40} for completion {i} at {where}, beyond float32's range "
                              f"(+-{_FLOAT32_MAX:.3g}), in which rewards are summed and normalized; return values within it")
        out.append(x)
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
