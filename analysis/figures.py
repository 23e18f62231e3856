"""The paper's figures from runs: curves over RL steps, mean over seeds and a +-1 s.d. band.

| file stem | what | paper |
| --- | --- | --- |
| fig4_reward | reward vs step, one curve per strategy of the table (and held-out pass@1 beside it, for runs that evaluated) | Fig. 4 |
| fig5_entropy | sampler entropy vs step, one curve per strategy | Fig. 5 |
| fig8_aqn | reward vs step with AQN (the anchor's schedule) and without, per anchor | Fig. 8 |
| fig9_15_schedules | reward vs step per noise schedule, and each schedule's sigma | Figs. 9, 15 |
| fig10_lora_rank | reward vs step per LoRA rank, per anchor | Fig. 10 |
| fig16_17_lr | reward vs step per learning rate, per anchor | Figs. 16, 17 |
| optuna_history, optuna_importance | a sweep's objective per trial, and parameter importances | - |

Ablation figures compare runs one factor at a time around an anchor: the nvfp4_lora (QeRL) runs
and the full_precision runs. A curve groups the runs whose settings equal the anchor's except
for the factor studied; runs that differ in anything else are not drawn. Every file is written
as PNG, and also as PDF when asked (`formats`, `python -m analysis --pdf`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from analysis.runs import Run, flatten, settings
from analysis.stats import mean, stdev
from analysis.table import order as table_order
from analysis.table import select

ANCHORS = ("nvfp4_lora", "full_precision")
BAND_NOTE = "line: mean over seeds; band: +-1 s.d. across seeds"
PNG = ("png",)  # the default output; ("png", "pdf") adds a PDF of each figure


@dataclass
class Curve:
    """One line of a figure: the per-step mean and s.d. of a metric over a group's runs."""

    label: str
    steps: list[int]
    mean: list[float]
    std: list[float]
    n: int


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (the first points average what exists)."""
    if window <= 1:
        return values
    return [mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def curve(label: str, runs: list[Run], metric: str, smooth: int = 1) -> Curve:
    """Mean and s.d. over `runs` of `metric`, at the steps every run logged it."""
    per_run = []
    for r in runs:
        steps, values = r.series(metric)
        per_run.append(dict(zip(steps, _smooth(values, smooth))))
    common = sorted(set.intersection(*(set(d) for d in per_run))) if per_run else []
    columns = [[d[s] for d in per_run] for s in common]
    return Curve(label, common, [mean(c) for c in columns],
                 [stdev(c) if len(c) > 1 else 0.0 for c in columns], len(runs))


# --------------------------------------------------------------------------- run grouping


def _anchor_settings(runs: list[Run], name: str, vary: tuple[str, ...]) -> dict | None:
    """The settings (ignoring `vary`) of the `name` runs in the strategy table, if any."""
    groups, _ = select(runs)
    if name not in groups:
        return None
    return {k: repr(v) for k, v in settings(groups[name][0], vary).items()}


def ablation(runs: list[Run], anchor: str, vary: tuple[str, ...]) -> dict[str, list[Run]]:
    """Runs equal to the `anchor` strategy's runs except in the `vary` keys, grouped and labelled.

    Args:
        runs: complete, labelled runs.
        anchor: a strategy preset name.
        vary: config key prefixes that may differ (e.g. `("noise",)`, `("train.lr",)`).

    Returns:
        {label: runs}, labels naming the values of the `vary` keys that differ between groups.
    """
    ref = _anchor_settings(runs, anchor, vary)
    if ref is None:
        return {}
    groups: dict[tuple, list[Run]] = {}
    for r in runs:
        if {k: repr(v) for k, v in settings(r, vary).items()} != ref:
            continue
        items = {k: repr(v) for k, v in flatten(r.config).items() if any(k == p or k.startswith(p + ".") for p in vary)}
        if items.get("noise.schedule") == repr("none"):  # without AQN its sigmas are unused: one group
            items = {k: v for k, v in items.items() if k == "noise.schedule" or not k.startswith("noise.")}
        groups.setdefault(tuple(sorted(items.items())), []).append(r)
    return _labelled(groups)


def _labelled(groups: dict[tuple, list[Run]]) -> dict[str, list[Run]]:
    """Name each group by the keys whose values differ between groups (`schedule=exp, ...`)."""
    if len(groups) == 1:
        (key, members), = groups.items()
        return {_short(dict(key)): members}
    dicts = {key: dict(key) for key in groups}
    varying = [k for k in sorted(set().union(*dicts.values())) if len({d[k] for d in dicts.values() if k in d}) > 1]
    out = {}
    for key, members in groups.items():
        label = ", ".join(f"{k.rsplit('.', 1)[-1]}={dicts[key][k].strip(chr(39))}" for k in varying if k in dicts[key])
        out[label] = members
    return dict(sorted(out.items()))


def _short(d: dict) -> str:
    main = [k for k in ("noise.schedule", "lora.r", "train.lr", "quant.format") if k in d]
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={d[k].strip(chr(39))}" for k in main) or "all runs"


# --------------------------------------------------------------------------- drawing


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw(ax, curves: list[Curve], ylabel: str, title: str, log: bool = False) -> None:
    for c in curves:
        if not c.steps:
            continue
        (line,) = ax.plot(c.steps, c.mean, label=f"{c.label} (n={c.n})", lw=1.6)
        lo = [m - s for m, s in zip(c.mean, c.std)]
        hi = [m + s for m, s in zip(c.mean, c.std)]
        ax.fill_between(c.steps, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
    if log:
        positive = [v for c in curves for v in c.mean if v > 0]
        ax.set_yscale("symlog", linthresh=min(positive) if positive else 1e-6)
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if len(curves) > 6:  # many curves: the legend goes beside the axes, not over the bands
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    elif any(c.steps for c in curves):
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no runs for this panel", ha="center", va="center", transform=ax.transAxes)


def _save(fig, out_dir: Path, stem: str, suptitle: str, band_note: bool = True, formats: tuple[str, ...] = PNG) -> list[Path]:
    fig.suptitle(suptitle, fontsize=11)
    if band_note:
        fig.text(0.99, 0.01, BAND_NOTE, ha="right", va="bottom", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    paths = [out_dir / f"{stem}.{suffix}" for suffix in formats]
    for p in paths:
        fig.savefig(p, dpi=150)
    _plt().close(fig)
    return paths


def _metric_label(name: str, smooth: int) -> str:
    return name + (f"\n(moving avg. over {smooth} steps)" if smooth > 1 else "")


def _reward_label(smooth: int) -> str:
    return _metric_label("reward", smooth)


def _single_note(groups: dict) -> str:
    return " (only one setting in these runs)" if len(groups) == 1 else ""


def strategy_figures(runs: list[Run], out_dir: Path, smooth: int = 1, formats: tuple[str, ...] = PNG) -> list[Path]:
    """Figs. 4 and 5 over the table's runs: reward per strategy; sampler entropy and entropy gain.

    The entropy gain (sampler minus full-precision reference on the same tokens) removes the
    prompt-to-prompt swings that every strategy shares, leaving what quantization and AQN add.
    """
    plt = _plt()
    groups, _ = select(runs)
    groups = {name: groups[name] for name in table_order(groups)}
    heldout = [curve(n, m, "eval/pass@1") for n, m in groups.items()]
    evaluated = any(c.steps for c in heldout)
    fig, axes = plt.subplots(1, 2 if evaluated else 1, figsize=(14 if evaluated else 8.4, 4.2), squeeze=False)
    _draw(axes[0, 0], [curve(n, m, "reward", smooth) for n, m in groups.items()], _metric_label("reward", smooth),
          "reward per strategy")
    if evaluated:  # runs with eval.every: the held-out accuracy beside the training reward
        _draw(axes[0, 1], heldout, "held-out greedy pass@1", "held-out pass@1 per strategy (eval.every)")
    paths = _save(fig, out_dir, "fig4_reward", "Reward vs step by strategy (paper Fig. 4)", formats=formats)
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.2))
    _draw(left, [curve(n, m, "sampler/entropy", smooth) for n, m in groups.items()],
          _metric_label("sampler entropy (nats)", smooth), "sampler token entropy")
    left.get_legend().remove()
    _draw(right, [curve(n, m, "entropy_gain", smooth) for n, m in groups.items()],
          _metric_label("entropy gain (nats)", smooth), "entropy gain over the full-precision reference")
    right.axhline(0, color="0.3", lw=0.8)
    paths += _save(fig, out_dir, "fig5_entropy", "Entropy vs step by strategy (paper Fig. 5)", formats=formats)
    return paths


def ablation_figure(runs: list[Run], out_dir: Path, stem: str, vary: tuple[str, ...], title: str,
                    keep=None, relabel: dict[str, str] | None = None, smooth: int = 1,
                    formats: tuple[str, ...] = PNG) -> list[Path]:
    """Reward vs step per value of `vary`, one panel per anchor (QeRL and full precision).

    Args:
        keep: a predicate on a group's first run; groups it rejects are not drawn.
        relabel: curve labels to replace (e.g. `{"schedule=none": "AQN off"}`).
    """
    plt = _plt()
    panels = []
    for anchor in ANCHORS:
        groups = ablation(runs, anchor, vary)
        if keep is not None:
            groups = {k: v for k, v in groups.items() if keep(v[0])}
        if groups:
            panels.append((anchor, groups))
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6.2 * max(1, len(panels)), 4.2), squeeze=False)
    for ax, (anchor, groups) in zip(axes[0], panels):
        curves = [curve((relabel or {}).get(label, label), members, "reward", smooth) for label, members in groups.items()]
        _draw(ax, curves, _reward_label(smooth), f"around {anchor}{_single_note(groups)}")
    if not panels:
        _draw(axes[0][0], [], _reward_label(smooth), "no anchor runs (nvfp4_lora or full_precision)")
    return _save(fig, out_dir, stem, title, formats=formats)


def schedule_figure(runs: list[Run], out_dir: Path, smooth: int = 1, formats: tuple[str, ...] = PNG) -> list[Path]:
    """Figs. 9 and 15: reward per noise schedule around QeRL, and each schedule's sigma."""
    plt = _plt()
    groups = ablation(runs, ANCHORS[0], ("noise",))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.4, 4.2))
    note = _single_note(groups) if groups else " (no nvfp4_lora runs)"
    _draw(left, [curve(k, v, "reward", smooth) for k, v in groups.items()], _reward_label(smooth),
          f"reward per noise schedule around {ANCHORS[0]}{note}")
    _draw(right, [curve(k, v, "noise/sigma") for k, v in groups.items()], "AQN sigma (symlog scale)",
          "sigma per step (stage 0 is noise-free)", log=True)
    return _save(fig, out_dir, "fig9_15_schedules", "Noise schedules: reward (paper Fig. 9) and sigma (paper Fig. 15)",
                 formats=formats)


AQN_LABELS = {"schedule=exp": "AQN on (exp schedule)", "schedule=none": "AQN off"}


def _aqn_on_or_off(run: Run) -> bool:
    """Fig. 8 compares the paper's schedule (exp, as in nvfp4_lora and bf16_aqn) with no AQN."""
    return run.get("noise.schedule") in ("exp", "none")


def write_all(runs: list[Run], out_dir: Path, smooth: int = 1, formats: tuple[str, ...] = PNG) -> list[Path]:
    """Write every run-based figure into `out_dir` (PNG; `formats` may add PDF); return the paths.

    Args:
        runs: complete, labelled runs (`analysis.runs.load(...).runs`).
        out_dir: the figures' directory (created if needed).
        smooth: moving average over this many steps on reward and entropy curves (1: none).
        formats: the files of each figure, by suffix (`PNG`, or `("png", "pdf")`).

    Example:
        .. code-block:: python

            from analysis import figures, runs

            paths = figures.write_all(runs.load(["runs/strategies"]).runs, "report/figures", smooth=5)
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = strategy_figures(runs, out_dir, smooth, formats)
    paths += ablation_figure(runs, out_dir, "fig8_aqn", ("noise",), "AQN on vs off (paper Fig. 8)",
                             keep=_aqn_on_or_off, relabel=AQN_LABELS, smooth=smooth, formats=formats)
    paths += schedule_figure(runs, out_dir, smooth, formats)
    paths += ablation_figure(runs, out_dir, "fig10_lora_rank", ("lora",), "LoRA rank (paper Fig. 10)", smooth=smooth,
                             formats=formats)
    paths += ablation_figure(runs, out_dir, "fig16_17_lr", ("train.lr",),
                             "Learning-rate robustness (paper Figs. 16-17)", smooth=smooth, formats=formats)
    return paths


# --------------------------------------------------------------------------- optuna


def check_storage(storage: str, study_name: str | None) -> None:
    """Check that an Optuna storage can be read and holds `study_name` (None: any), before any work.

    Raises:
        ValueError: one line: not a URL, a SQLite file that does not exist (Optuna would make an
            empty one), a storage that does not open, or no such study (the ones there listed).
    """
    import optuna
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(storage)
    except (ArgumentError, ValueError):
        raise ValueError(f"--optuna-storage {storage!r} is not a URL; use sqlite:///PATH or postgresql://USER@HOST/DB") from None
    shown = url.render_as_string(hide_password=True)
    if url.get_backend_name() == "sqlite" and not Path(url.database or "").is_file():
        raise ValueError(f"--optuna-storage {shown}: {url.database or '(no file)'} does not exist "
                         "(a sweep's storage is SWEEP_DIR/study.db)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        names = optuna.study.get_all_study_names(storage)
    except Exception as e:  # noqa: BLE001 - drivers raise many types; all mean "cannot open"
        text = str(getattr(e, "orig", None) or e).strip()
        raise ValueError(f"cannot open --optuna-storage {shown}: {text.splitlines()[0] if text else type(e).__name__}") from None
    if study_name is not None and study_name not in names:
        raise ValueError(f"no study {study_name!r} in {shown} (studies there: {', '.join(names) or 'none'}); "
                         "give --optuna-study NAME")


def optuna_figures(storage: str, study_name: str | None, out_dir: Path,
                   formats: tuple[str, ...] = PNG) -> tuple[list[Path], list[str]]:
    """The optimization history and the parameter importances of an Optuna study.

    A multi-objective study gets one history panel per objective and the importances of its
    first objective. Importances are drawn only when the objective varies across trials.

    Args:
        storage: an Optuna storage URL (e.g. `sqlite:///sweeps.db`, `postgresql://...`).
        study_name: the study; None picks the only study in the storage.
        out_dir: where `optuna_history.*` and `optuna_importance.*` go.
        formats: the files of each figure, by suffix.

    Returns:
        (written paths, notes on what could not be drawn).
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if study_name is None:
        names = optuna.study.get_all_study_names(storage)
        if len(names) != 1:
            return [], [f"storage holds {len(names)} studies ({', '.join(names)}); pass --optuna-study"]
        study_name = names[0]
    study = optuna.load_study(study_name=study_name, storage=storage)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and t.values]
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    if not done:
        return [], [f"study {study_name}: no complete trials"]
    plt = _plt()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = _objective_names(study)
    fig, axes = plt.subplots(1, len(names), figsize=(7 * len(names), 4.2), squeeze=False)
    for i, (ax, name, direction) in enumerate(zip(axes[0], names, study.directions)):
        _draw_history(ax, done, pruned, i, name, direction == optuna.study.StudyDirection.MAXIMIZE)
    fig.suptitle(f"Optuna optimization history: {study_name}, {len(done)} complete, {len(pruned)} pruned", fontsize=11)
    paths = _save(fig, out_dir, "optuna_history", fig._suptitle.get_text(), band_note=False, formats=formats)
    values = {t.values[0] for t in done}
    if len(done) < 2 or not any(t.params for t in done):
        return paths, [f"study {study_name}: importance needs two complete trials with parameters"]
    if len(values) == 1:
        return paths, [f"study {study_name}: every complete trial has {names[0]} = {values.pop():g}; "
                       "parameter importance is undefined, so optuna_importance is not drawn"]
    # Optuna's own plot with its default evaluator, called as `qerl_exp.sweep.report` calls it, so
    # the sweep's report and these figures draw one definition of importance
    from optuna.visualization import matplotlib as vis

    target = None if len(names) == 1 else (lambda t: t.values[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's experimental-API and evaluator notices
        fig = vis.plot_param_importances(study, target=target, target_name=names[0]).figure
    paths += _save(fig, out_dir, "optuna_importance", f"Optuna parameter importance: {study_name}", band_note=False,
                    formats=formats)
    return paths, []


def _objective_names(study) -> list[str]:
    """Optuna's metric names; else the metrics recorded by `qerl_exp.sweep`; else `objective i`."""
    if study.metric_names:
        return list(study.metric_names)
    recorded = study.user_attrs.get("qerl_sweep", {}).get("identity", {}).get("objectives") or []
    names = [o.get("metric") for o in recorded if isinstance(o, dict)]
    if len(names) == len(study.directions) and all(names):
        return names
    return [f"objective {i}" for i in range(len(study.directions))]


def _draw_history(ax, done, pruned, index: int, name: str, maximize: bool) -> None:
    """One objective's value per complete trial, the best so far, and pruned trials as grey lines."""
    numbers = [t.number for t in done]
    values = [t.values[index] for t in done]
    ax.scatter(numbers, values, s=18, label="complete trial")
    best, line = None, []
    for v in values:
        best = v if best is None else (max(best, v) if maximize else min(best, v))
        line.append(best)
    ax.step(numbers, line, where="post", color="C3", label="best so far")
    for t in pruned:
        ax.axvline(t.number, color="0.8", lw=0.8, zorder=0)
    if pruned:
        ax.plot([], [], color="0.8", lw=0.8, label="pruned trial")
    ax.set_xlabel("trial number")
    ax.set_ylabel(f"{name} ({'maximize' if maximize else 'minimize'})")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
