"""What a finished study leaves in its sweep directory.

- `best_overrides.yaml`: the best trial's full override list (the spec's base, the command line's
  overrides and the trial's values), with the value and the rerun command in its header;
  `best_overrides.txt` holds the same overrides one per line, for
  `python -m qerl_exp $(cat SWEEP_DIR/best_overrides.txt)`. A multi-objective study has a Pareto
  front instead: `pareto_front.yaml` and one `pareto/trialNNNN.txt` per optimal trial.
- `trials.csv`: one row per trial (state, values, parameters, pruning step, retries, run dirs).
- `plots/*.png`: optimization history, parameter importances, parallel coordinates, slice and
  intermediate values (single objective), or the Pareto front and importances per objective. The
  slice plot is a grid, three parameters a row; log axes label only their decades, and the
  parallel coordinates widen with the parameter count, so many parameters stay readable.

When every complete trial scored the same, the study learned nothing about its parameters at this
budget: `summary_lines` says so in one line, and the importance plot's title says its equal bars
mean nothing.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
import warnings
from pathlib import Path
from typing import Callable

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from qerl_exp.sweep.spec import Plan, override_key
from qerl_exp.sweep.storage import shown
from qerl_exp.sweep.study import counts, was_interrupted


def write_reports(plan: Plan, study: optuna.Study) -> list[Path]:
    """Write the best overrides, `trials.csv` and the plots; returns the paths written."""
    plan.sweep_dir.mkdir(parents=True, exist_ok=True)
    trials = study.get_trials(deepcopy=False)
    written = [_write(plan.sweep_dir / "trials.csv", _csv(plan, trials))]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete and len(plan.objectives) == 1:
        written += _best(plan, study.best_trial)
    elif complete:
        written += _pareto(plan, study.best_trials)
    written += _plots(plan, study)
    return written


def rerun_command(plan: Plan, name: str = "best_overrides.txt") -> str:
    return f"python -m qerl_exp $(cat {_rel(plan.sweep_dir / name)})"


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _write(path: Path, text: str) -> Path:
    """Write atomically: several machines may write the same report of a shared study."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def _rerun_overrides(plan: Plan, trial: FrozenTrial) -> list[str]:
    overrides = list(trial.user_attrs.get("overrides", []))
    if len(plan.seeds) == 1 and not any(override_key(o) == "seed" for o in overrides):  # a grid's seed parameter
        overrides.append(f"seed={plan.seeds[0]}")
    return overrides


def _header(plan: Plan, trial: FrozenTrial, txt: str) -> str:
    values = ", ".join(f"{o.metric} = {v:.6g}" for o, v in zip(plan.objectives, trial.values))
    seeds = f"seed {plan.seeds[0]}" if len(plan.seeds) == 1 else f"averaged over seeds {plan.seeds}; add seed=N to pick one"
    return (f"# Trial {trial.number} of study '{plan.study_name}' ({shown(plan.storage)}): {values}\n"
            f"# objective: {'; '.join(o.describe() for o in plan.objectives)}; {seeds}\n"
            f"# rerun it: {rerun_command(plan, txt)}\n")


def _best(plan: Plan, trial: FrozenTrial) -> list[Path]:
    overrides = _rerun_overrides(plan, trial)
    header = _header(plan, trial, "best_overrides.txt")
    return [_write(plan.sweep_dir / "best_overrides.yaml", header + yaml.safe_dump(overrides, sort_keys=False)),
            _write(plan.sweep_dir / "best_overrides.txt", "\n".join(overrides) + "\n")]


def _pareto(plan: Plan, front: list[FrozenTrial]) -> list[Path]:
    out_dir = plan.sweep_dir / "pareto"
    out_dir.mkdir(exist_ok=True)
    entries, written = [], []
    for t in sorted(front, key=lambda t: t.number):
        overrides = _rerun_overrides(plan, t)
        txt = f"pareto/trial{t.number:04d}.txt"
        written.append(_write(plan.sweep_dir / txt, "\n".join(overrides) + "\n"))
        entries.append({"trial": t.number, "values": {o.metric: v for o, v in zip(plan.objectives, t.values)},
                        "rerun": rerun_command(plan, txt), "overrides": overrides})
    head = (f"# Pareto-optimal trials of study '{plan.study_name}' ({shown(plan.storage)}): "
            f"{'; '.join(o.describe() for o in plan.objectives)}\n")
    written.append(_write(plan.sweep_dir / "pareto_front.yaml", head + yaml.safe_dump(entries, sort_keys=False)))
    return written


def _csv(plan: Plan, trials: list[FrozenTrial]) -> str:
    params: list[str] = []
    for t in trials:
        params += [p for p in t.params if p not in params]
    value_cols = ["value"] if len(plan.objectives) == 1 else [f"value:{o.metric}" for o in plan.objectives]
    cols = ["number", "state", *value_cols, *params, "pruned_at_step", "retry_of", "interrupted", "error",
            "duration_s", "datetime_start", "datetime_complete", "worker", "run_dirs"]
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(cols)
    for t in trials:
        values = t.values if t.values is not None else [None] * len(value_cols)
        duration = t.duration.total_seconds() if t.duration is not None else None
        w.writerow([t.number, t.state.name, *values, *[t.params.get(p) for p in params],
                    t.user_attrs.get("pruned_at_step"), t.system_attrs.get("failed_trial"),
                    bool(t.user_attrs.get("interrupted")) or None, t.user_attrs.get("error"),
                    None if duration is None else round(duration, 2), t.datetime_start, t.datetime_complete,
                    t.user_attrs.get("worker"), " ".join(t.user_attrs.get("run_dirs", []))])
    return buf.getvalue()


def tied(study: optuna.Study) -> FrozenTrial | None:
    """A complete trial whose values every other complete trial shares (two or more), else None."""
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    if len(complete) < 2:
        return None
    first = complete[0].values
    same = all(all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(t.values, first)) for t in complete)
    return complete[0] if same else None


def _plots(plan: Plan, study: optuna.Study) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as vis

    out_dir = plan.sweep_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    names = [o.metric for o in plan.objectives]
    tie = " (all trials tie: equal bars, nothing learned)" if tied(study) else ""
    jobs: list[tuple[str, Callable]] = []
    if len(names) == 1:
        jobs += [("optimization_history", lambda: vis.plot_optimization_history(study, target_name=names[0])),
                 ("intermediate_values", lambda: vis.plot_intermediate_values(study)),
                 ("parallel_coordinate", lambda: vis.plot_parallel_coordinate(study, target_name=names[0])),
                 ("slice", lambda: slice_grid(complete, lambda t: t.value, names[0]))]
        if len(complete) >= 2:
            jobs.append(("param_importances", lambda: vis.plot_param_importances(study, target_name=names[0])))
    else:
        jobs.append(("pareto_front", lambda: vis.plot_pareto_front(study, target_names=names)))
        for i, name in enumerate(names):
            slug = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
            target = (lambda i: lambda t: t.values[i])(i)
            if len(complete) >= 2:
                jobs.append((f"param_importances_{slug}", (lambda target, name: lambda: vis.plot_param_importances(
                    study, target=target, target_name=name))(target, name)))
            jobs.append((f"slice_{slug}", (lambda target, name: lambda: slice_grid(complete, target, name))(target, name)))
    written = []
    for name, make in jobs:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ax = make()
        except Exception as e:  # noqa: BLE001 - a plot Optuna cannot draw for this study is skipped
            print(f"warning: plot {name} skipped: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")
            continue
        first = ax.flat[0] if hasattr(ax, "flat") else ax
        fig = first.figure
        if name.startswith("param_importances") and tie:
            first.set_title(first.get_title() + tie)
        if name == "parallel_coordinate":
            _declutter(fig, len({p for t in complete for p in t.params}))
        path = out_dir / f"{name}.png"
        tmp = path.with_name(f".{name}.{os.getpid()}.png")
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.replace(tmp, path)
        plt.close(fig)
        written.append(path)
    return written


def slice_grid(trials: list[FrozenTrial], target: Callable[[FrozenTrial], float], name: str):
    """Objective against each parameter, one panel per parameter, three to a row.

    Args:
        trials: the complete trials to draw.
        target: the value of a trial to put on the y axis.
        name: the y axis label.

    Returns:
        The figure's axes (a 2-D array; panels past the last parameter are hidden).
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter
    from optuna.distributions import CategoricalDistribution

    params = sorted({p for t in trials for p in t.params})
    if not params:
        raise ValueError("no complete trial with parameters")
    cols = min(3, len(params))
    rows = -(-len(params) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False, sharey=True, layout="constrained")
    for ax, p in zip(axes.flat, params):
        have = [t for t in trials if p in t.params]
        dist = have[0].distributions[p]
        if isinstance(dist, CategoricalDistribution):
            labels = [str(c) for c in dist.choices]
            xs = [labels.index(str(t.params[p])) for t in have]
            ax.set_xticks(range(len(labels)), labels, rotation=30 if sum(map(len, labels)) > 24 else 0, ha="right")
            ax.set_xlim(-0.5, len(labels) - 0.5)
        else:
            xs = [t.params[p] for t in have]
            if getattr(dist, "log", False):
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(NullFormatter())  # decades only: minor labels collide
        points = ax.scatter(xs, [target(t) for t in have], c=[t.number for t in have], cmap="Blues",
                            vmin=0, vmax=max(t.number for t in trials), edgecolors="grey", s=30)
        ax.set_title(p, fontsize=10)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(params):]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_ylabel(name)
    fig.colorbar(points, ax=axes, label="trial", fraction=0.03)
    fig.suptitle(f"Slice plot: {name} by parameter ({len(trials)} complete trials)")
    return axes


def _declutter(fig, n_params: int) -> None:
    """Optuna's parallel coordinates at any parameter count: width per axis, no minor labels."""
    from matplotlib.ticker import NullFormatter

    fig.set_size_inches(max(6.4, 1.5 * (n_params + 1)), 5.0)
    for ax in fig.axes:
        ax.yaxis.set_minor_formatter(NullFormatter())


def summary_lines(plan: Plan, study: optuna.Study) -> list[str]:
    """What the command prints at the end."""
    trials = study.get_trials(deepcopy=False)
    n = counts(trials)
    resumed = sum(map(was_interrupted, trials))
    lines = [f"study '{plan.study_name}': {n[TrialState.COMPLETE] + n[TrialState.PRUNED]} trials finished "
             f"({n[TrialState.COMPLETE]} complete, {n[TrialState.PRUNED]} pruned), {n[TrialState.FAIL] - resumed} failed "
             f"and retried or replaced, {resumed} interrupted and resumed, in {shown(plan.storage)}"]
    if n[TrialState.COMPLETE] and len(plan.objectives) == 1:
        b = study.best_trial
        params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in b.params.items())
        lines.append(f"best trial {b.number}: {plan.objectives[0].metric} = {b.value:.4g}  ({params})")
        lines.append(f"rerun it: {rerun_command(plan)}")
    elif n[TrialState.COMPLETE]:
        lines.append(f"Pareto front: trials {', '.join(str(t.number) for t in sorted(study.best_trials, key=lambda t: t.number))} "
                     f"(see {_rel(plan.sweep_dir / 'pareto_front.yaml')})")
    tie = tied(study)
    if tie is not None:
        values = ", ".join(f"{o.metric} = {v:.4g}" for o, v in zip(plan.objectives, tie.values))
        lines.append(f"warning: all {n[TrialState.COMPLETE]} complete trials tie ({values}): nothing to learn at this "
                     "budget; raise train.steps or the task's difficulty, or widen the space")
    lines.append(f"sweep dir: {_rel(plan.sweep_dir)}  (trials/, trials.csv, plots/, logs/)")
    return lines

