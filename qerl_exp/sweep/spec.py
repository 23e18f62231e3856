"""Sweep specs: the YAML file in `sweeps/`, its settings, and the search space it defines.

A spec names the Hydra overrides every trial starts from (`base`), the search space (`params`,
and optionally a `space:` function for derived or conditional values), the objective(s) read from
the metrics every run logs, the sampler, the pruner and the trial count. `load_plan` reads one,
merges the command line into it and validates everything it can before a single trial runs:
unknown keys and parameters, bad ranges and values that the config schema would refuse all end
in one `UsageError` line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import math
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import optuna
import yaml
from omegaconf import OmegaConf

from qerl_exp.cli import validate
from qerl_exp.config.compose import expand_sweep, group_options, search_dirs
from qerl_exp.rl.metrics import FINAL_FRACTION, check_logged, final_window
from qerl_exp.run.console import UsageError

# Keys of the command line that set the sweep itself; every other key=value is a Hydra override.
SETTINGS = ("n_trials", "n_jobs", "storage", "study_name", "sweep_dir", "heartbeat_interval", "grace_period",
            "max_retry", "max_failures")
SPEC_KEYS = ("study_name", "base", "configs", "params", "space", "objective", "objectives", "seeds", "sampler", "pruner",
             "enqueue", *SETTINGS)
SAMPLERS = {"grid": "GridSampler", "tpe": "TPESampler", "random": "RandomSampler", "gp": "GPSampler", "cmaes": "CmaEsSampler",
            "nsgaii": "NSGAIISampler", "nsgaiii": "NSGAIIISampler", "qmc": "QMCSampler"}
PRUNERS = {"median": "MedianPruner", "percentile": "PercentilePruner", "hyperband": "HyperbandPruner",
           "successive_halving": "SuccessiveHalvingPruner", "threshold": "ThresholdPruner",
           "wilcoxon": "WilcoxonPruner", "none": "NopPruner"}
REDUCES = ("mean", "auc")
# The parameter that picks one of the spec's `configs` (named lists of overrides).
CONFIG = "config"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class Objective:
    """One value to optimize, computed from a metric that every run logs to `metrics.jsonl`/W&B.

    Args:
        metric: a logged metric name, e.g. `reward` or `perf/rollout_tok_s`.
        direction: `maximize` or `minimize`.
        reduce: `mean` averages the last `last` steps; `auc` is the area under the whole curve
            divided by its length (trapezoids), so it rewards learning early.
        last: `mean` only: the fraction in (0, 1] of the run's steps, counted from its end; the
            default is the window of a run's `reward/final` (`metrics.FINAL_FRACTION`).
        last_steps: `mean` only: a number of steps instead (takes precedence over `last`).
    """

    metric: str
    direction: str = "maximize"
    reduce: str = "mean"
    last: float = FINAL_FRACTION
    last_steps: int | None = None

    def window(self, steps: int) -> int:
        """How many trailing steps `mean` averages for a run of `steps` steps (by default the window
        of a run's `reward/final`, `metrics.final_window`)."""
        if self.last_steps is not None:
            return max(1, min(steps, self.last_steps))
        return final_window(steps, self.last)

    def value(self, series: list[float], steps: int) -> float:
        """The objective of one run (or of its first steps so far) from the metric's per-step values."""
        xs = [x for x in series if x is not None and math.isfinite(x)]
        if not xs:
            return float("nan")
        if self.reduce == "auc":
            return xs[0] if len(xs) == 1 else sum((a + b) / 2 for a, b in zip(xs, xs[1:])) / (len(xs) - 1)
        tail = xs[-self.window(steps):]
        return sum(tail) / len(tail)

    def describe(self) -> str:
        if self.reduce == "auc":
            how = "area under the curve"
        elif self.last_steps is not None:
            how = f"mean of the last {self.last_steps} steps"
        elif self.last >= 1:
            how = "mean over all steps"
        else:
            how = f"mean of the last {self.last:.0%} of the steps"
        return f"{self.direction} {self.metric} ({how})"


@dataclass(frozen=True)
class Param:
    """One searched value: a config key (`noise.sigma_start`) or a config group (`noise`).

    Args:
        name: the override key.
        distribution: its Optuna distribution.
        when: suggest it only if every earlier parameter named here has one of the listed values.
    """

    name: str
    distribution: optuna.distributions.BaseDistribution
    when: dict[str, list] = field(default_factory=dict)


@dataclass
class Plan:
    """Everything a sweep needs, resolved from the spec file and the command line.

    Args:
        spec_path: the spec file.
        spec: the spec as read (recorded in the study).
        study_name: the study's name in the storage (default: the spec file's name).
        overrides: the spec's `base` followed by the command line's Hydra overrides.
        params: the declared parameters, in order.
        space: `file.py:function` called with the trial after `params`; it returns more overrides.
        objectives: one (single-objective) or more (multi-objective).
        seeds: each trial runs once per seed; objectives are averaged over the seeds.
        sampler: `{name: ..., **kwargs}` of an Optuna sampler.
        pruner: `{name: ..., **kwargs}` of an Optuna pruner; `none` for multi-objective studies.
        enqueue: parameter dicts tried first (e.g. the paper's schedule).
        configs: named override lists; the parameter `config` picks one per trial (a grid's rows).
        n_trials: finished (complete or pruned) trials the whole study should reach.
        n_jobs: worker processes this command starts.
        storage: SQLAlchemy URL of the study's storage.
        sweep_dir: where trial run directories, logs and reports go.
        heartbeat_interval: seconds between a running trial's heartbeats.
        grace_period: seconds without a heartbeat after which a trial counts as dead, failed and
            is retried.
        max_retry: times a dead or interrupted trial is retried with the same parameters.
        max_failures: a worker stops after this many trials in a row raised errors.
    """

    spec_path: Path
    spec: dict
    study_name: str
    overrides: list[str]
    params: list[Param]
    space: str | None
    objectives: list[Objective]
    seeds: list[int]
    sampler: dict
    pruner: dict
    enqueue: list[dict]
    n_trials: int
    n_jobs: int = 1
    storage: str = ""
    sweep_dir: Path = Path(".")
    heartbeat_interval: int = 10
    grace_period: int = 30
    max_retry: int = 2
    max_failures: int = 3
    configs: dict[str, list[str]] = field(default_factory=dict)

    @property
    def directions(self) -> list[str]:
        return [o.direction for o in self.objectives]

    @property
    def grid(self) -> bool:
        return self.sampler["name"] == "grid"

    def identity(self) -> dict:
        """What must not change when a study is resumed: the search, the objective, the base config."""
        return {"overrides": self.overrides, "params": self.spec.get("params"), "space": self.space,
                "space_sha": _space_sha(self), "objectives": [dataclasses.asdict(o) for o in self.objectives],
                "seeds": self.seeds, **({"configs": self.configs} if self.configs else {})}


# ---------------------------------------------------------------------------------------------
# Reading a spec


def load_plan(spec_path: Path, argv: list[str], *, check_config: bool = True, spec: dict | None = None) -> Plan:
    """Read `spec_path`, apply the command line `argv` (`key=value` items) and validate.

    Args:
        spec_path: the YAML spec.
        argv: sweep settings (`n_trials=6`, `storage=...`) and Hydra overrides (`train.steps=6`).
        check_config: compose the Hydra config to check every parameter against it (a sampled
            dry run of the space); workers skip this, the command already did it.
        spec: the spec's contents when already read.

    Raises:
        UsageError: with one line saying what is wrong and where.
    """
    spec_path = Path(spec_path)
    where = str(spec_path)
    spec = _read_spec(spec_path, spec)
    merged, cli_overrides, study_name = _settings(spec, argv, spec_path)
    base, configs, params, space, objectives, seeds = _search(spec, where)
    sampler, pruner, enqueue, n_trials = _optimizer(spec, merged, objectives, params, space, where)
    sweep_dir = Path(merged.get("sweep_dir") or Path("sweeps/runs") / study_name).expanduser().resolve()
    plan = Plan(
        spec_path=spec_path.resolve(), spec=spec, study_name=study_name, overrides=merge_overrides(base, cli_overrides),
        params=params, space=space, objectives=objectives, seeds=seeds, sampler=sampler, pruner=pruner,
        enqueue=enqueue, n_trials=_int(n_trials, "n_trials", 1), n_jobs=_int(merged.get("n_jobs", 1), "n_jobs", 1),
        storage=str(merged.get("storage") or f"sqlite:///{sweep_dir / 'study.db'}"), sweep_dir=sweep_dir,
        heartbeat_interval=_int(merged.get("heartbeat_interval", 10), "heartbeat_interval", 1),
        max_retry=_int(merged.get("max_retry", 2), "max_retry", 0),
        max_failures=_int(merged.get("max_failures", 3), "max_failures", 1), configs=configs,
    )
    plan.grace_period = _int(merged.get("grace_period", 3 * plan.heartbeat_interval), "grace_period", 1)
    if plan.grace_period <= plan.heartbeat_interval:
        raise UsageError(f"grace_period={plan.grace_period} must exceed heartbeat_interval={plan.heartbeat_interval}")
    if check_config:
        _check_config(plan)
    return plan


def _read_spec(spec_path: Path, spec: dict | None) -> dict:
    """The spec's mapping (read from `spec_path` unless given), its keys checked."""
    where = str(spec_path)
    if spec is None:
        if not spec_path.is_file():
            raise UsageError(f"no sweep spec at {spec_path}")
        try:
            spec = yaml.safe_load(spec_path.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" (line {mark.line + 1})" if mark is not None else ""
            raise UsageError(f"{where}: not valid YAML{at}: {getattr(e, 'problem', None) or str(e).splitlines()[0]}") from None
    if not isinstance(spec, dict):
        raise UsageError(f"{where}: a sweep spec is a YAML mapping (base, params, objective, ...)")
    unknown = [k for k in spec if k not in SPEC_KEYS]
    if unknown:
        raise UsageError(f"{where}: unknown key '{unknown[0]}'; valid keys: {', '.join(SPEC_KEYS)}")
    return spec


def _settings(spec: dict, argv: list[str], spec_path: Path) -> tuple[dict, list[str], str]:
    """The sweep settings (the spec's, then the command line's), the command line's overrides, and
    the study's name; a run_dir or resume override refused (every trial has its own run directory)."""
    settings, cli_overrides = _split_argv(argv)
    named = [o for o in [*spec.get("base", []), *cli_overrides] if isinstance(o, str) and override_key(o) in ("run_dir", "resume")]
    if named:
        raise UsageError(f"{named[0]}: a sweep gives each trial its own run directory (SWEEP_DIR/trials/...); "
                         "drop it, and set sweep_dir= to move them")
    merged = {**{k: spec[k] for k in SETTINGS if k in spec}, **settings}
    study_name = str(merged.get("study_name") or spec_path.stem)
    if not _NAME.match(study_name):
        raise UsageError(f"study_name={study_name!r} may hold only letters, digits, '_', '.' and '-'")
    return merged, cli_overrides, study_name


def _search(spec: dict, where: str) -> tuple[list[str], dict[str, list[str]], list[Param], str | None, list[Objective], list[int]]:
    """What the study searches: the base overrides, the configs, the parameters (the configs' pick
    first), the space function, the objectives and the seeds every trial runs."""
    base = spec.get("base", [])
    if not isinstance(base, list) or not all(isinstance(o, str) and "=" in o for o in base):
        raise UsageError(f"{where}: base must be a list of Hydra overrides like 'quant=nf4' or 'train.steps=30'")
    configs = _configs(spec.get("configs"), where)
    params = _params(spec.get("params") or {}, where)
    if configs:
        if CONFIG in [p.name for p in params]:
            raise UsageError(f"{where}: params.{CONFIG} is the parameter that picks one of configs; rename it")
        params.insert(0, Param(CONFIG, optuna.distributions.CategoricalDistribution(list(configs))))
    if "seed" in [p.name for p in params] and "seeds" in spec:
        raise UsageError(f"{where}: give seeds (every trial runs each) or a seed parameter (one per trial), not both")
    space = spec.get("space")
    if space is not None and (not isinstance(space, str) or ":" not in space):
        raise UsageError(f"{where}: space must name a function as 'file.py:function' (relative to the spec)")
    if not params and space is None:
        raise UsageError(f"{where}: the search space is empty; add params (or a space function)")
    objectives = _objectives(spec, where)
    seeds = spec.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise UsageError(f"{where}: seeds must be a non-empty list of integers")
    if not all(0 <= s < 2**32 for s in seeds):
        raise UsageError(f"{where}: seeds must be integers in 0..{2**32 - 1}, got {seeds}")
    return base, configs, params, space, objectives, seeds


def _optimizer(spec: dict, merged: dict, objectives: list[Objective], params: list[Param], space: str | None,
               where: str) -> tuple[dict, dict, list[dict], object]:
    """How the study picks trials: the sampler, the pruner (median for one objective, none else),
    the enqueued points and the number of trials (a grid's size unless given)."""
    sampler = _named(spec.get("sampler", {"name": "tpe"}), "sampler", SAMPLERS, where)
    default_pruner = {"name": "median"} if len(objectives) == 1 and sampler["name"] != "grid" else {"name": "none"}
    pruner = _named(spec.get("pruner", default_pruner), "pruner", PRUNERS, where)
    if len(objectives) > 1 and pruner["name"] != "none":
        raise UsageError(f"{where}: Optuna prunes single-objective studies only; set 'pruner: {{name: none}}'")
    enqueue = spec.get("enqueue", [])
    if not isinstance(enqueue, list) or not all(isinstance(e, dict) for e in enqueue):
        raise UsageError(f"{where}: enqueue must be a list of parameter mappings")
    n_trials = merged.get("n_trials")
    if sampler["name"] == "grid":
        size = _check_grid(params, space, enqueue, where)
        n_trials = size if n_trials is None else n_trials
        if _int(n_trials, "n_trials", 1) > size:
            raise UsageError(f"n_trials={n_trials} exceeds the grid's {size} points; leave n_trials out to run each once")
    if n_trials is None:
        raise UsageError(f"{where}: set n_trials in the spec or on the command line (n_trials=20)")
    return sampler, pruner, enqueue, n_trials


def _split_argv(argv: list[str]) -> tuple[dict, list[str]]:
    settings, overrides = {}, []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq:
            raise UsageError(f"'{arg}' is not key=value; settings are {', '.join(SETTINGS)}, anything else a Hydra override")
        if key in SETTINGS:
            settings[key] = value
        else:
            overrides.append(arg)
    if overrides:
        try:
            jobs = expand_sweep(overrides)
        except Exception as e:  # noqa: BLE001 - the parser's errors are user errors
            raise UsageError(f"cannot parse the overrides: {str(e).strip().splitlines()[0]}") from None
        if len(jobs) > 1:
            raise UsageError("comma or range sweeps are Hydra multirun syntax; put searched values in the spec's params")
    return settings, overrides


def _int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not re.fullmatch(r"-?\d+", str(value).strip()):
        raise UsageError(f"{name}={value!r} must be a whole number")
    v = int(str(value).strip())
    if v < low:
        raise UsageError(f"{name}={v} must be >= {low}")
    return v


def _num(value: Any, where: str) -> float:
    try:  # YAML 1.1 reads 1e-3 (no dot) as a string
        number = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{where}: {value!r} is not a number") from None
    if not math.isfinite(number):
        raise UsageError(f"{where}: {value!r} is not a finite number")
    return number


def _params(raw: Any, where: str) -> list[Param]:
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: params must map config keys to ranges, e.g. 'noise.sigma_start: {{type: float, low: 1e-3, high: 1e-1, log: true}}'")
    out: list[Param] = []
    for name, p in raw.items():
        at = f"{where}: params.{name}"
        if not isinstance(p, dict) or "type" not in p:
            raise UsageError(f"{at}: give a mapping with type: float | int | categorical")
        kind, extra = p["type"], set(p) - {"type", "low", "high", "log", "step", "choices", "when"}
        if extra:
            raise UsageError(f"{at}: unknown field '{sorted(extra)[0]}'; valid: type, low, high, log, step, choices, when")
        try:
            if kind == "categorical":
                if not isinstance(p.get("choices"), list) or not p["choices"]:
                    raise UsageError(f"{at}: categorical needs a non-empty choices list")
                dist = optuna.distributions.CategoricalDistribution(p["choices"])
            elif kind in ("float", "int"):
                if "low" not in p or "high" not in p:
                    raise UsageError(f"{at}: {kind} needs low and high")
                low, high = _num(p["low"], at), _num(p["high"], at)
                step = None if p.get("step") is None else _num(p["step"], at)
                if kind == "float":
                    dist = optuna.distributions.FloatDistribution(low, high, log=bool(p.get("log", False)), step=step)
                else:
                    if not (low.is_integer() and high.is_integer()):
                        raise UsageError(f"{at}: int needs whole-number low and high")
                    dist = optuna.distributions.IntDistribution(int(low), int(high), log=bool(p.get("log", False)),
                                                                step=int(step or 1))
            else:
                raise UsageError(f"{at}: type {kind!r} is not one of float, int, categorical")
        except ValueError as e:
            if isinstance(e, UsageError):
                raise
            raise UsageError(f"{at}: {str(e).splitlines()[0]}") from None
        when = p.get("when") or {}
        if not isinstance(when, dict):
            raise UsageError(f"{at}: when must map an earlier parameter to its value(s)")
        for dep, values in when.items():
            if dep not in [q.name for q in out]:
                raise UsageError(f"{at}: when refers to '{dep}', which is not a parameter declared above it")
        out.append(Param(name, dist, {d: v if isinstance(v, list) else [v] for d, v in when.items()}))
    return out


def _configs(raw: Any, where: str) -> dict[str, list[str]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not raw:
        raise UsageError(f"{where}: configs must map names to override lists, e.g. 'nvfp4_lora: [strategy=nvfp4_lora]'")
    for name, overrides in raw.items():
        if not _NAME.match(str(name)):
            raise UsageError(f"{where}: configs.{name}: a name may hold only letters, digits, '_', '.' and '-'")
        if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
            raise UsageError(f"{where}: configs.{name} must be a list of Hydra overrides like 'strategy=nvfp4_lora'")
    return {str(k): list(v) for k, v in raw.items()}


def _check_grid(params: list[Param], space: str | None, enqueue: list, where: str) -> int:
    """A grid's parameters are categorical or int, unconditional, with nothing else to sample; returns its size."""
    if space is not None or enqueue:
        raise UsageError(f"{where}: sampler grid runs every point of its params once; drop space and enqueue")
    if not params:
        raise UsageError(f"{where}: sampler grid needs params (categorical or int) or configs")
    for p in params:
        if p.when or isinstance(p.distribution, optuna.distributions.FloatDistribution):
            raise UsageError(f"{where}: params.{p.name}: a grid takes categorical or int params without when")
    size = len(grid_points(params))
    if size < 2:
        raise UsageError(f"{where}: the grid has one point, which is one run: python -m qerl_exp with its overrides")
    return size


def grid_axes(params: list[Param]) -> dict[str, list]:
    """A grid's values per parameter: categorical choices, int ranges (Optuna's GridSampler search space)."""
    return {p.name: list(p.distribution.choices) if isinstance(p.distribution, optuna.distributions.CategoricalDistribution)
            else list(range(p.distribution.low, p.distribution.high + 1, p.distribution.step)) for p in params}


def grid_points(params: list[Param]) -> list[dict[str, Any]]:
    """Every point of a grid over `params`, the last parameter varying fastest and a spec's `configs`
    fastest of all: every row runs a seed before any row runs the next, so that a study cut short
    holds whole sets of rows to pair."""
    axes = grid_axes(params)
    if CONFIG in axes:
        axes = {**{k: v for k, v in axes.items() if k != CONFIG}, CONFIG: axes[CONFIG]}
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def _objectives(spec: dict, where: str) -> list[Objective]:
    if ("objective" in spec) == ("objectives" in spec):
        raise UsageError(f"{where}: give exactly one of objective (a mapping) or objectives (a list, multi-objective)")
    raw = [spec["objective"]] if "objective" in spec else spec["objectives"]
    if not isinstance(raw, list) or not raw:
        raise UsageError(f"{where}: objectives must be a non-empty list")
    out = []
    for i, o in enumerate(raw):
        at = f"{where}: objective" + (f" {i}" if "objectives" in spec else "")
        if not isinstance(o, dict) or not isinstance(o.get("metric"), str):
            raise UsageError(f"{at}: needs metric: <a logged metric name, e.g. reward>")
        extra = set(o) - {"metric", "direction", "reduce", "last", "last_steps"}
        if extra:
            raise UsageError(f"{at}: unknown field '{sorted(extra)[0]}'; valid: metric, direction, reduce, last, last_steps")
        last_steps = None if o.get("last_steps") is None else _int(o["last_steps"], f"{at}: last_steps", 1)
        obj = Objective(o["metric"], str(o.get("direction", "maximize")), str(o.get("reduce", "mean")),
                        _num(o.get("last", FINAL_FRACTION), at), last_steps)
        try:  # a typo here would otherwise surface only after a whole trial
            check_logged(obj.metric)
        except ValueError as e:
            raise UsageError(f"{at}: {e}") from None
        if obj.direction not in ("maximize", "minimize"):
            raise UsageError(f"{at}: direction={obj.direction!r}; choose maximize or minimize")
        if obj.reduce not in REDUCES:
            raise UsageError(f"{at}: reduce={obj.reduce!r}; choose one of: {', '.join(REDUCES)}")
        if not 0 < obj.last <= 1:
            raise UsageError(f"{at}: last={obj.last:g} must be a fraction in (0, 1]; count steps with last_steps: N")
        out.append(obj)
    return out


def _named(raw: Any, what: str, table: dict[str, str], where: str) -> dict:
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, dict) or raw.get("name") not in table:
        name = raw.get("name") if isinstance(raw, dict) else raw
        raise UsageError(f"{where}: {what} {name!r} is not known; choose one of: {', '.join(table)}")
    return dict(raw)


# ---------------------------------------------------------------------------------------------
# Building Optuna objects from a plan


def make_sampler(plan: Plan, seed_offset: int = 0) -> optuna.samplers.BaseSampler:
    kwargs = {k: v for k, v in plan.sampler.items() if k != "name"}
    if kwargs.get("seed") is not None:
        kwargs["seed"] = (int(kwargs["seed"]) + seed_offset) % 2**32
    if plan.grid:
        kwargs["search_space"] = grid_axes(plan.params)
    return _build(optuna.samplers, SAMPLERS[plan.sampler["name"]], kwargs, "sampler")


def make_pruner(plan: Plan) -> optuna.pruners.BasePruner:
    kwargs = {k: v for k, v in plan.pruner.items() if k != "name"}
    return _build(optuna.pruners, PRUNERS[plan.pruner["name"]], kwargs, "pruner")


def _build(module, cls_name: str, kwargs: dict, what: str):
    try:
        return getattr(module, cls_name)(**kwargs)
    except (TypeError, ValueError, ImportError, ModuleNotFoundError) as e:
        raise UsageError(f"{what} {cls_name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}): {str(e).splitlines()[0]}") from None


# ---------------------------------------------------------------------------------------------
# Turning a trial into overrides


def suggest(plan: Plan, trial: optuna.Trial) -> dict[str, Any]:
    """Draw this trial's values: the declared `params` (respecting `when`), then the `space` function.

    Returns:
        `{override key: value}`, e.g. `{"noise": "cosine", "noise.sigma_start": 0.012}`.
    """
    values: dict[str, Any] = {}
    for p in plan.params:
        if all(values.get(dep) in allowed for dep, allowed in p.when.items()):
            values[p.name] = _suggest_one(trial, p)
    if plan.space:
        extra = _space_function(plan)(trial)
        if not isinstance(extra, dict):
            raise UsageError(f"{plan.space} must return a dict of overrides, got {type(extra).__name__}")
        values.update(extra)
    return values


def _suggest_one(trial: optuna.Trial, p: Param) -> Any:
    d = p.distribution
    if isinstance(d, optuna.distributions.CategoricalDistribution):
        return trial.suggest_categorical(p.name, d.choices)
    if isinstance(d, optuna.distributions.IntDistribution):
        return trial.suggest_int(p.name, d.low, d.high, step=d.step, log=d.log)
    return trial.suggest_float(p.name, d.low, d.high, step=d.step, log=d.log)


def override(key: str, value: Any) -> str:
    """A Hydra override string for one value (floats keep full precision)."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, (list, tuple)):
        text = "[" + ",".join(override("", v)[1:] for v in value) + "]"
    elif value is None:
        text = "null"
    else:
        text = str(value)
        if not re.fullmatch(r"[\w./:+-]*", text):
            text = "'" + text.replace("'", "\\'") + "'"
    return f"{key}={text}"


def override_key(item: str) -> str:
    return item.partition("=")[0].lstrip("+~")


def merge_overrides(*lists: list[str]) -> list[str]:
    """Concatenate override lists; a later override of the same key replaces the earlier one."""
    merged: dict[str, str] = {}
    for items in lists:
        for item in items:
            merged.pop(override_key(item), None)
            merged[override_key(item)] = item
    return list(merged.values())


def value_overrides(plan: Plan, key: str, value: Any) -> list[str]:
    """The overrides one parameter value stands for: a config's list, or `key=value`."""
    return list(plan.configs[value]) if key == CONFIG and plan.configs else [override(key, value)]


def trial_overrides(plan: Plan, values: dict[str, Any]) -> list[str]:
    """The overrides that reproduce a trial: the plan's base and command line, then its values."""
    return merge_overrides(plan.overrides, *[value_overrides(plan, k, v) for k, v in values.items()])


def trial_seeds(plan: Plan, values: dict[str, Any]) -> list[int]:
    """The seeds a trial runs: its `seed` parameter when the spec searches one, else the spec's seeds."""
    return [values["seed"]] if "seed" in values else plan.seeds


_SPACES: dict[str, Callable] = {}


def _space_function(plan: Plan) -> Callable[[optuna.Trial], dict]:
    file, _, name = plan.space.rpartition(":")
    path = (plan.spec_path.parent / file).resolve()
    if f"{path}:{name}" in _SPACES:
        return _SPACES[f"{path}:{name}"]
    if not path.is_file():
        raise UsageError(f"{plan.spec_path}: space file {path} does not exist")
    mod_name = f"_qerl_sweep_space_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file
        raise UsageError(f"{path}: cannot import it: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UsageError(f"{path} has no function '{name}'")
    _SPACES[f"{path}:{name}"] = fn
    return fn


def _space_sha(plan: Plan) -> str | None:
    if not plan.space:
        return None
    path = (plan.spec_path.parent / plan.space.rpartition(":")[0]).resolve()
    return hashlib.sha1(path.read_bytes()).hexdigest()[:12] if path.is_file() else None


# ---------------------------------------------------------------------------------------------
# Validation against the Hydra config


def _check_config(plan: Plan, dry_runs: int = 4) -> None:
    """Compose the config once for the declared keys, then a few sampled trials end to end."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        cfg = validate(plan.overrides, multirun=False)[0]
    except UsageError as e:
        raise UsageError(f"overrides: {e}") from None
    for p in plan.params:
        if not (p.name == CONFIG and plan.configs):
            _check_key(p.name, p.distribution, cfg, plan)
    # Every declared value at its range's ends (or every choice), with its conditions met.
    for p in plan.params:
        d = p.distribution
        corners = d.choices if isinstance(d, optuna.distributions.CategoricalDistribution) else (d.low, d.high)
        deps = [o for dep, allowed in p.when.items() for o in value_overrides(plan, dep, allowed[0])]
        for value in corners:
            try:
                validate(merge_overrides(plan.overrides, deps, value_overrides(plan, p.name, value)), multirun=False)
            except UsageError as e:
                at = f"configs.{value}" if p.name == CONFIG and plan.configs else f"params.{p.name}={value}"
                raise UsageError(f"{plan.spec_path}: {at}: {e}") from None
    # Dry runs: the sampler's own view of the space, through every `when` and the space function.
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), directions=plan.directions)
    samples = [dict(e) for e in plan.enqueue]
    for e in samples:
        study.enqueue_trial(e)
    for _ in range(len(samples) + dry_runs):
        trial = study.ask()
        try:
            values = suggest(plan, trial)
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's space function
            raise UsageError(f"{plan.space}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        for key in values:
            if key not in {p.name for p in plan.params}:
                _check_key(key, None, cfg, plan)
        try:
            validate(trial_overrides(plan, values), multirun=False)
        except UsageError as e:
            shown = " ".join(override(k, v) for k, v in values.items())
            raise UsageError(f"{plan.spec_path}: trial {shown}: {e}") from None
        study.tell(trial, [0.0] * len(plan.directions))


def _check_key(key: str, dist, cfg, plan: Plan) -> None:
    spec_path, options = plan.spec_path, group_options(key, plan.overrides)  # presets of conf/ and --config-dir
    if "." not in key and any((d / key).is_dir() for d in search_dirs(plan.overrides)):
        if dist is not None:
            if not isinstance(dist, optuna.distributions.CategoricalDistribution):
                raise UsageError(f"{spec_path}: params.{key} is a config group; give it type: categorical with preset names")
            for c in dist.choices:
                if str(c) not in options:
                    raise UsageError(f"{spec_path}: params.{key}: '{c}' is not a preset; choose from: {', '.join(options)}")
        return
    if OmegaConf.select(OmegaConf.structured(cfg), key, default=_MISSING) is _MISSING:
        raise UsageError(f"{spec_path}: unknown parameter '{key}': not a config key or group (see python -m qerl_exp --cfg job)")


_MISSING = object()


def host() -> str:
    return socket.gethostname()
