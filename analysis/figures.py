"""The paper's figures from runs: curves over RL steps, each panel over the paired difference of its
rows from a reference row.

Top panels: the mean over seeds with a +-1 s.d. band; curves are moving averages over `SMOOTH` steps
by default, with the unsmoothed means drawn faint. Bottom panels: per step, the mean over (base,
seed) pairs of a row's value minus the reference row's (full precision; an ablation's own anchor
setting), with the 95 % t-interval over the pairs: where the pairs share prompts and random draws,
differences that eight overlapping bands hide are sharp. A curve that coincides with an earlier one
at every step is dashed and named as equal in the legend.

| file stem | what | paper |
| --- | --- | --- |
| fig4_reward | reward vs step, one curve per strategy of the table (and held-out pass@1 beside it, for runs that evaluated) | Fig. 4 |
| fig5_entropy | sampler entropy vs step, one curve per strategy | Fig. 5 |
| fig8_aqn | reward vs step with AQN (the anchor's schedule) and without, per anchor | Fig. 8 |
| fig9_15_schedules | reward vs step per noise schedule, and each schedule's sigma | Figs. 9, 15 |
| fig10_lora_rank | reward vs step per LoRA rank, per anchor | Fig. 10 |
| fig16_17_lr | reward vs step per learning rate, per anchor | Figs. 16, 17 |
| fig_fork_discovery | `task=fork`: share of completions on route B and the route token's entropy per row (sweep config) | - |
| optuna_history, optuna_importance | a sweep's objective per trial, and parameter importances | - |

Ablation figures compare runs one factor at a time around an anchor: the nvfp4_lora (QeRL) runs
and the full_precision runs. A curve groups the runs whose settings equal the anchor's except
for the factor studied; runs that differ in anything else are not drawn. Every file is written
as PNG, and also as PDF when asked (`formats`, `python -m analysis --pdf`).
"""

from __future__ import annotations

import warnings
import math
from dataclasses import dataclass, field
from pathlib import Path

from analysis.compare import REFERENCE, unit
from analysis.runs import Run, flatten, settings
from analysis.stats import mean, stdev, t_interval
from analysis.table import order as table_order
from analysis.table import select

ANCHORS = ("nvfp4_lora", "full_precision")
BAND_NOTE = ("top: mean over seeds, band +-1 s.d. across seeds; bottom: paired difference from the reference "
             "(same base and seed), band its 95 % t-interval over the pairs; faint: before smoothing")
SMOOTH = 5  # the default moving average over steps of every curve
PNG = ("png",)  # the default output; ("png", "pdf") adds a PDF of each figure


@dataclass
class Curve:
    """One line of a figure: the per-step mean and spread of a metric over a group's runs (`raw`:
    the mean before smoothing, drawn faint), or of their paired differences from a reference
    (`spread` the half-width of the 95 % t-interval over the pairs)."""

    label: str
    steps: list[int]
    mean: list[float]
    std: list[float]
    n: int
    raw: list[float] = field(default_factory=list)


def _smooth(steps: list[int], values: list[float], window: int) -> list[float]:
    """Trailing moving average over the last `window` steps (the values logged at steps
    s - window + 1 .. s): a metric logged every 10 steps is left as it is by a window of 5."""
    if window <= 1:
        return values
    return [mean([v for t, v in zip(steps[:i + 1], values[:i + 1]) if t > s - window]) for i, s in enumerate(steps)]


def _per_step(runs: list[Run], metric: str, smooth: int) -> list[tuple[dict, dict]]:
    """Per run, `{step: smoothed value}` and `{step: value}` of `metric`."""
    out = []
    for r in runs:
        steps, values = r.series(metric)
        out.append((dict(zip(steps, _smooth(steps, values, smooth))), dict(zip(steps, values))))
    return out


def curve(label: str, runs: list[Run], metric: str, smooth: int = 1) -> Curve:
    """Mean and s.d. over `runs` of `metric`, at the steps every run logged it."""
    per_run = _per_step(runs, metric, smooth)
    common = sorted(set.intersection(*(set(d) for d, _ in per_run))) if per_run else []
    columns = [[d[s] for d, _ in per_run] for s in common]
    return Curve(label, common, [mean(c) for c in columns], [stdev(c) if len(c) > 1 else 0.0 for c in columns],
                 len(runs), [mean([raw[s] for _, raw in per_run]) for s in common])


def difference(label: str, runs: list[Run], reference: list[Run], metric: str, smooth: int = 1) -> Curve:
    """Per step, the mean over (base, seed) pairs of a run's `metric` minus its reference run's,
    with the half-width of the 95 % t-interval over the pairs as the band (`compare.unit` pairs them)."""
    ref = {unit(r): d for r, d in zip(reference, _per_step(reference, metric, smooth))}
    pairs = [(d, ref[unit(r)]) for r, d in zip(runs, _per_step(runs, metric, smooth)) if unit(r) in ref]
    common = sorted(set.intersection(*(set(a) & set(b) for (a, _), (b, _) in pairs))) if pairs else []
    columns = [[a[s] - b[s] for (a, _), (b, _) in pairs] for s in common]
    raw = [mean([ra[s] - rb[s] for (_, ra), (_, rb) in pairs]) for s in common]
    intervals = [t_interval(c) for c in columns]
    return Curve(label, common, [iv.mean for iv in intervals],
                 [0.0 if math.isnan(iv.low) else iv.half_width for iv in intervals], len(pairs), raw)


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


def coinciding(curves: list[Curve]) -> dict[int, str]:
    """For each curve equal at every step to an earlier one (the same steps and means), that
    curve's label: drawn on top of each other, the later would hide the earlier."""
    out = {}
    for j, c in enumerate(curves):
        same = next((o.label for o in curves[:j] if c.steps and o.steps == c.steps and o.mean == c.mean), None)
        if same is not None:
            out[j] = same
    return out


def _draw(ax, curves: list[Curve], ylabel: str, title: str, log: bool = False, zero: bool = False,
          colors: dict[str, str] | None = None) -> None:
    """Each curve with its band and, when smoothed, its unsmoothed mean as faint points; a curve
    that coincides with an earlier one is dashed and says so in the legend. `colors`: a colour per
    label, so that a row keeps its colour from panel to panel."""
    same = coinciding(curves)
    for j, c in enumerate(curves):
        if not c.steps:
            continue
        label = f"{c.label} (n={c.n})" + (f" = {same[j]}" if j in same else "")
        (line,) = ax.plot(c.steps, c.mean, label=label, lw=1.6, ls="--" if j in same else "-",
                          color=(colors or {}).get(c.label))
        if c.raw and c.raw != c.mean:
            ax.plot(c.steps, c.raw, ls="none", marker=".", ms=2.5, alpha=0.3, color=line.get_color())
        lo = [m - s for m, s in zip(c.mean, c.std)]
        hi = [m + s for m, s in zip(c.mean, c.std)]
        ax.fill_between(c.steps, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
    if log:
        positive = [v for c in curves for v in c.mean if v > 0]
        ax.set_yscale("symlog", linthresh=min(positive) if positive else 1e-6)
    if zero:
        ax.axhline(0, color="0.3", lw=0.8)
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


def _panels(columns: int, width: float = 6.2):
    """A figure of `columns` panels over their difference panels (`axes[0]` on top, `axes[1]` below)."""
    return _plt().subplots(2, columns, figsize=(width * columns, 7.2), squeeze=False, sharex="col",
                           gridspec_kw={"height_ratios": [3, 2]})


def _draw_pair(top, bottom, groups: dict[str, list[Run]], metric: str, ylabel: str, title: str, reference: str | None,
               smooth: int, log: bool = False, zero: bool = False) -> None:
    """`metric` per group on `top`; each group's paired difference from the `reference` group below,
    in the same colour."""
    colors = {label: f"C{i % 10}" for i, label in enumerate(groups)}
    _draw(top, [curve(label, members, metric, smooth) for label, members in groups.items()], ylabel, title, log, zero,
          colors)
    others = [difference(label, members, groups[reference], metric, smooth) for label, members in groups.items()
              if label != reference] if reference in groups else []
    if not others:  # no reference, or nothing beside it
        bottom.set_axis_off()
        top.tick_params(labelbottom=True)  # the shared axis shows its ticks on the panel left
        return
    _draw(bottom, others, f"{metric} - {reference}", f"difference from {reference} (paired)", zero=True, colors=colors)


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


def strategy_figures(runs: list[Run], out_dir: Path, smooth: int = SMOOTH, formats: tuple[str, ...] = PNG) -> list[Path]:
    """Figs. 4 and 5 over the table's runs: reward per strategy (and held-out pass@1 for runs that
    evaluated); sampler entropy (on-policy) and the same-token entropy gain; each over its difference
    from full precision.

    The same-token entropy gain (sampler minus full-precision reference on the sampler's tokens) removes the
    prompt-to-prompt swings that every strategy shares, leaving what quantization and AQN add.
    """
    groups, _ = select(runs)
    groups = {name: groups[name] for name in table_order(groups)}
    evaluated = any(curve(n, m, "eval/pass@1").steps for n, m in groups.items())
    fig, axes = _panels(2 if evaluated else 1, 7.0)
    _draw_pair(axes[0, 0], axes[1, 0], groups, "reward", _metric_label("reward", smooth), "reward per strategy",
               REFERENCE, smooth)
    if evaluated:  # runs with eval.every: the held-out accuracy beside the training reward
        _draw_pair(axes[0, 1], axes[1, 1], groups, "eval/pass@1", "held-out greedy pass@1",
                   "held-out pass@1 per strategy (eval.every)", REFERENCE, 1)
    paths = _save(fig, out_dir, "fig4_reward", "Reward vs step by strategy (paper Fig. 4)", formats=formats)
    fig, axes = _panels(2, 7.0)
    _draw_pair(axes[0, 0], axes[1, 0], groups, "sampler/entropy", _metric_label("sampler entropy (nats)", smooth),
               "sampler token entropy, on its own rollouts", REFERENCE, smooth)
    _draw_pair(axes[0, 1], axes[1, 1], groups, "entropy_gain", _metric_label("same-token entropy gain (nats)", smooth),
               "same-token entropy gain over the full-precision reference", REFERENCE, smooth, zero=True)
    paths += _save(fig, out_dir, "fig5_entropy", "Entropy vs step by strategy (paper Fig. 5)", formats=formats)
    return paths


def _anchor_group(groups: dict[str, list[Run]], anchor: str) -> str | None:
    """The group holding the anchor strategy's own runs: the one the others differ from."""
    return next((label for label, members in groups.items() if any(r.strategy == anchor for r in members)), None)


def ablation_figure(runs: list[Run], out_dir: Path, stem: str, vary: tuple[str, ...], title: str,
                    keep=None, relabel: dict[str, str] | None = None, smooth: int = SMOOTH,
                    formats: tuple[str, ...] = PNG) -> list[Path]:
    """Reward vs step per value of `vary`, one panel per anchor (QeRL and full precision), each over
    the differences from the anchor's own setting.

    Args:
        keep: a predicate on a group's first run; groups it rejects are not drawn.
        relabel: curve labels to replace (e.g. `{"schedule=none": "AQN off"}`).
    """
    panels = []
    for anchor in ANCHORS:
        groups = ablation(runs, anchor, vary)
        if keep is not None:
            groups = {k: v for k, v in groups.items() if keep(v[0])}
        if groups:
            panels.append((anchor, {(relabel or {}).get(label, label): members for label, members in groups.items()}))
    fig, axes = _panels(max(1, len(panels)))
    for col, (anchor, groups) in enumerate(panels):
        _draw_pair(axes[0, col], axes[1, col], groups, "reward", _reward_label(smooth),
                   f"around {anchor}{_single_note(groups)}", _anchor_group(groups, anchor), smooth)
    if not panels:
        _draw(axes[0, 0], [], _reward_label(smooth), "no anchor runs (nvfp4_lora or full_precision)")
        axes[1, 0].set_axis_off()
        axes[0, 0].tick_params(labelbottom=True)
    return _save(fig, out_dir, stem, title, formats=formats)


def schedule_figure(runs: list[Run], out_dir: Path, smooth: int = SMOOTH, formats: tuple[str, ...] = PNG) -> list[Path]:
    """Figs. 9 and 15: reward per noise schedule around QeRL over its difference from the exp
    schedule, and each schedule's sigma."""
    groups = ablation(runs, ANCHORS[0], ("noise",))
    fig, axes = _panels(2)
    note = _single_note(groups) if groups else " (no nvfp4_lora runs)"
    _draw_pair(axes[0, 0], axes[1, 0], groups, "reward", _reward_label(smooth),
               f"reward per noise schedule around {ANCHORS[0]}{note}", _anchor_group(groups, ANCHORS[0]), smooth)
    _draw(axes[0, 1], [curve(k, v, "noise/sigma") for k, v in groups.items()], "AQN sigma (symlog scale)",
          "sigma per step (stage 0 is noise-free)", log=True)
    axes[1, 1].set_axis_off()
    axes[0, 1].tick_params(labelbottom=True)
    return _save(fig, out_dir, "fig9_15_schedules", "Noise schedules: reward (paper Fig. 9) and sigma (paper Fig. 15)",
                 formats=formats)


def config_rows(runs: list[Run]) -> dict[str, list[Run]]:
    """The runs by the sweep config that made them (`choices.config`), else by strategy preset."""
    rows: dict[str, list[Run]] = {}
    for r in runs:
        rows.setdefault(r.choices.get("config") or r.strategy or r.name, []).append(r)
    return rows


def fork_figure(runs: list[Run], out_dir: Path, smooth: int = SMOOTH, formats: tuple[str, ...] = PNG) -> list[Path]:
    """`task=fork`: the share of completions on route B and the route token's entropy per row, each
    over its paired difference from full precision; nothing for runs of other tasks."""
    rows = {label: members for label, members in config_rows(runs).items() if members[0].series("fork/b_share")[0]}
    if not rows:
        return []
    rows = dict(sorted(rows.items(), key=lambda item: item[0] != REFERENCE))  # the reference first
    reference = REFERENCE if REFERENCE in rows else None
    fig, axes = _panels(2, 7.0)
    _draw_pair(axes[0, 0], axes[1, 0], rows, "fork/b_share", _metric_label("share of completions on route B", smooth),
               "discovery of route B", reference, smooth)
    _draw_pair(axes[0, 1], axes[1, 1], rows, "fork/route_entropy", _metric_label("route-token entropy (nats)", smooth),
               "the sampler's entropy at the route token", reference, smooth)
    return _save(fig, out_dir, "fig_fork_discovery", "task=fork: route B's discovery by row", formats=formats)


AQN_LABELS = {"schedule=exp": "AQN on (exp schedule)", "schedule=none": "AQN off"}


def _aqn_on_or_off(run: Run) -> bool:
    """Fig. 8 compares the paper's schedule (exp, as in nvfp4_lora and bf16_aqn) with no AQN."""
    return run.get("noise.schedule") in ("exp", "none")


def write_all(runs: list[Run], out_dir: Path, smooth: int = SMOOTH, formats: tuple[str, ...] = PNG) -> list[Path]:
    """Write every run-based figure into `out_dir` (PNG; `formats` may add PDF); return the paths.

    Args:
        runs: complete, labelled runs (`analysis.runs.load(...).runs`).
        out_dir: the figures' directory (created if needed).
        smooth: moving average over this many steps of every curve (1: none; the unsmoothed means are drawn
            faint beside the smoothed ones).
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
    paths += fork_figure(runs, out_dir, smooth, formats)
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
