"""`python -m analysis wandb-report`: a W&B report of a strategy group or a sweep, built in code.

The report holds the paper's figures as live W&B panels over the runs of one W&B group: the
strategy runs (`sweeps/strategies.sh`; their group is the task, e.g. `arith`, or a multirun's
folder name) or one Optuna study (its group is the study name). Runs are grouped by the Hydra
choices every run records in its W&B config (`choices.strategy`, `choices.noise`, ...).

| section | panels |
| --- | --- |
| strategy group | reward, sampler entropy, entropy gain and quant/kl by strategy (Figs. 4, 5); sigma by noise schedule (Figs. 9, 15); memory and speed bars by strategy (Table 3) |
| sweep | reward, sampler entropy and sigma per trial and by noise schedule; parameter importance for the final reward |

Building needs no server: `--json FILE` writes the report's spec as W&B would store it. `--save`
uploads it (needs `wandb login` or `WANDB_API_KEY`, and the runs synced to that project) and
prints its address.

Example:
    python -m analysis wandb-report --project me/qerl-exp --group arith --save
    python -m analysis wandb-report --project me/qerl-exp --sweep noise_schedule --json /tmp/report.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import wandb_workspaces.reports.v2 as wr

from qerl_exp.run.console import one_line_argparse
from qerl_exp.run.files import user_path

STRATEGY = wr.Config("choices.strategy")
SCHEDULE = wr.Config("choices.noise")
TRIAL = wr.Config("choices.trial")
# (title, logged metric) of the curves a strategy comparison draws, one panel each.
STRATEGY_CURVES = (
    ("Reward by strategy (Fig. 4)", "reward"),
    ("Sampler entropy by strategy (Fig. 5)", "sampler/entropy"),
    ("Entropy gain over the full-precision reference", "entropy_gain"),
    ("KL(reference || quantized sampler)", "quant/kl"),
)
# (title, logged metrics) of the bars, one panel each: the last logged value per group.
STRATEGY_BARS = (
    ("Memory: peak and weights (bytes)", ["mem/peak_bytes", "mem/weights_bytes"]),
    ("Rollout speed (completion tokens/s)", ["perf/rollout_tok_s"]),
    ("Step time (s)", ["perf/step_s"]),
)


def _curve(title: str, metric: str, groupby=None, log_y: bool = False) -> wr.LinePlot:
    return wr.LinePlot(title=title, x="step", y=[metric], groupby=groupby, log_y=log_y or None,
                       groupby_aggfunc="mean" if groupby else None, groupby_rangefunc="stddev" if groupby else None,
                       layout=wr.Layout(w=12, h=8))


def strategy_panels() -> list[wr.interface.Panel]:
    """The panels of a strategy comparison (the paper's figures over the strategy presets)."""
    panels = [_curve(title, metric, STRATEGY) for title, metric in STRATEGY_CURVES]
    panels.append(_curve("Noise sigma by schedule (Figs. 9, 15)", "noise/sigma", SCHEDULE, log_y=True))
    panels += [wr.BarPlot(title=title, metrics=metrics, groupby=STRATEGY, groupby_aggfunc="mean",
                          groupby_rangefunc="stddev", orientation="v", layout=wr.Layout(w=8, h=8))
               for title, metrics in STRATEGY_BARS]
    return panels


def sweep_panels() -> list[wr.interface.Panel]:
    """The panels of one Optuna study's trials."""
    return [
        _curve("Reward per trial", "reward", TRIAL),
        _curve("Reward by noise schedule", "reward", SCHEDULE),
        _curve("Sampler entropy by noise schedule", "sampler/entropy", SCHEDULE),
        _curve("Noise sigma per trial", "noise/sigma", TRIAL, log_y=True),
        wr.ParameterImportancePlot(with_respect_to="reward/final", layout=wr.Layout(w=12, h=8)),
    ]


def build(entity: str, project: str, group: str, kind: str, title: str = "") -> wr.Report:
    """The report of one W&B group's runs.

    Args:
        entity: the W&B entity (user or team) that owns the project.
        project: the W&B project the runs were synced to (`tracker.project`, default `qerl-exp`).
        group: the runs' W&B group: the task (strategy runs), a multirun's folder or a study name.
        kind: `strategy` (a strategy comparison) or `sweep` (one Optuna study).
        title: the report's title; empty names it after the group.

    Returns:
        The report object; nothing is sent until `save()`.

    Example:
        >>> report = build("me", "qerl-exp", "arith", "strategy")
        >>> [p.title for p in report.blocks[-1].panels][0]
        'Reward by strategy (Fig. 4)'
    """
    if kind not in ("strategy", "sweep"):
        raise ValueError(f"kind={kind!r}: choose strategy or sweep")
    runs = wr.Runset(entity=entity, project=project, name=group, filters=f"Metric('group') = '{group}'")
    what = "strategies" if kind == "strategy" else "sweep"
    intro = ("Strategy comparison: each curve is the mean over a strategy's seeds, the band one standard deviation."
             if kind == "strategy" else "One Optuna study: one run per trial and seed (group = study name).")
    return wr.Report(
        entity=entity, project=project, title=title or f"qerl-exp {what}: {group}",
        description=f"Built by `python -m analysis wandb-report` from the runs of W&B group '{group}'.",
        blocks=[wr.P(intro), wr.PanelGrid(runsets=[runs], panels=strategy_panels() if kind == "strategy" else sweep_panels())],
    )


def spec_json(report: wr.Report) -> str:
    """The report's spec as `save()` uploads it, as JSON, built without a server.

    The library's own serialisation is used; only the run sets' project lookup (the project's
    internal id, which only the server knows) is left out, by serialising them without entity and
    project (the report's own entity and project are kept).
    """
    blocks = [replace(b, runsets=[replace(r, entity="", project="") for r in b.runsets]) if isinstance(b, wr.PanelGrid)
              else b for b in report.blocks]
    model = replace(report, blocks=blocks)._to_model()
    return json.dumps({"displayName": model.display_name, "description": model.description,
                       "project": {"entity": model.project.entity_name, "name": model.project.name},
                       "spec": json.loads(model.spec.model_dump_json(by_alias=True, exclude_none=True))}, indent=2)


def _parser() -> argparse.ArgumentParser:
    p = one_line_argparse(argparse.ArgumentParser(prog="python -m analysis wandb-report", description=__doc__.split("\n\n")[0],
                                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                                epilog=__doc__.split("\n", 2)[2]))
    p.add_argument("--project", required=True, metavar="ENTITY/PROJECT", help="the W&B project the runs were synced to")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--group", help="a strategy comparison: the runs' W&B group (the task, e.g. arith)")
    which.add_argument("--sweep", metavar="STUDY", help="an Optuna study: its name (the W&B group of its trials)")
    p.add_argument("--title", default="", help="the report's title (default: from the group)")
    p.add_argument("--json", type=user_path, metavar="FILE", help="write the report's spec here (no server needed)")
    p.add_argument("--save", action="store_true", help="upload the report to W&B and print its address")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m analysis wandb-report`; returns the exit status."""
    args = _parser().parse_args(argv)
    entity, _, project = args.project.partition("/")
    if not entity or not project or "/" in project:
        print(f"error: --project {args.project!r}: give ENTITY/PROJECT, e.g. me/qerl-exp", file=sys.stderr)
        return 2
    report = build(entity, project, args.group or args.sweep, "strategy" if args.group else "sweep", args.title)
    panels = report.blocks[-1].panels
    print(f"report '{report.title}': {len(panels)} panels over W&B group '{args.group or args.sweep}' in {args.project}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(spec_json(report))
        print(f"wrote {args.json}")
    if args.save:
        try:
            report.save()
        except Exception as e:  # noqa: BLE001 - auth, network and server errors all mean "not saved"
            text = str(e).strip()
            print(f"error: the report was not saved ({type(e).__name__}: {text.splitlines()[0] if text else ''}); "
                  "run `wandb login` (or set WANDB_API_KEY) and sync the runs first (`wandb sync RUN_DIR/wandb`)",
                  file=sys.stderr)
            return 1
        print(f"saved: {report.url}")
    elif not args.json:
        print("nothing written: add --json FILE to keep its spec, or --save to upload it")
    return 0
