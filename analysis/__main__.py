"""`python -m analysis PATH... [--out DIR]`: the strategy table and the paper's figures from runs.

PATH: run directories, parents of run directories (searched recursively), globs, or offline W&B
run files (`run-*.wandb`). DIR defaults to `report/` in the folder holding the runs (the
deepest folder common to the PATHs that is not itself a run), `runs/report` for a W&B project
alone. Writes into DIR:
  strategy_table.md, .csv, .tex    the strategy table (analysis/table.py)
  figures/*.png                    the figures (analysis/figures.py; --pdf adds a PDF of each)
  strategy_runs.md                 every run used, skipped (with the reason: failed runs with
                                   their error.txt line) or left out
  results_section.md               pass@1 on both evaluation splits (start, end, change), the
                                   diagnostics, each row's treatment at step 0 against --reference
                                   (KL to full precision, on-policy entropy gain, task=fork: pi(B)'s
                                   shift), every row's paired contrasts against it beside that dose
                                   and their minimum detectable effects (analysis/compare.py),
                                   route B's discovery and its dose-response (task=fork), the best
                                   AQN setting, the spread between identical runs, the commit and
                                   this command (analysis/section.py), for
                                   results/results.md to include verbatim (--into
                                   results/results.md puts it there, between its begin and end lines)
Prints the strategy table and, beside each row's dose at step 0, its contrasts on route B's
discovery (task=fork) or on the final training reward.

Example:
    python -m analysis runs/strategies                 # writes runs/strategies/report/
    python -m analysis multirun/strategies --out docs
    python -m analysis 'runs/**/run-*.wandb' --out /tmp/report
    python -m analysis --wandb-project me/qerl-exp --out /tmp/report
    python -m analysis runs --optuna-storage sqlite:///sweeps.db --optuna-study aqn --out /tmp/report
    python -m analysis wandb-report --project me/qerl-exp --group arith --save   (a W&B report)
    python -m analysis results/smollm2_study --out results/smollm2_study --into results/results.md
    python -m analysis determinism RUN_A RUN_B   (two runs of one config and seed, step by step)
    python -m analysis keep runs/smollm2_study results/smollm2_study   (a sweep's finished runs, to keep)
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import shlex
import sys
from pathlib import Path

from analysis import compare, determinism, figures, keep, section, table
from analysis.runs import load
from qerl_exp.run.console import one_line_argparse, tolerate_closed_pipes
from qerl_exp.run.files import check_writable, os_error_line, user_path
from qerl_exp.run.record import run_holding
from qerl_exp.sweep.storage import expand_sqlite


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of steps >= 1")
    return int(text)


def _margin(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    if name not in compare.OUTCOMES:
        raise argparse.ArgumentTypeError(f"{name!r} is not an outcome; choose one of: {', '.join(compare.OUTCOMES)}")
    try:
        margin = float(value)
    except ValueError:
        margin = math.nan
    if not margin > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the margin must be a number > 0, e.g. {name}=0.05")
    return name, margin


def _check_out(out: Path) -> None:
    """Refuse an output directory that cannot be made or written, or lies in a run directory (its
    files would mix with the run's), before any run is read."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory; give a directory (created if needed)")
    run = run_holding(out)
    if run is not None:
        raise ValueError(f"--out {out} is in the run directory {run}: the report would mix with the run's files; "
                         "give a folder outside it (by default: report/ beside the runs)")
    try:
        check_writable(out)
    except OSError as e:
        raise ValueError(os_error_line(e, "--out DIR")) from None


def _parser() -> argparse.ArgumentParser:
    p = one_line_argparse(argparse.ArgumentParser(prog="python -m analysis", description=__doc__.split("\n\n")[0],
                                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                                epilog=__doc__.split("\n", 2)[2]))
    p.add_argument("paths", nargs="*", help="run directories, their parents, globs, or run-*.wandb files")
    p.add_argument("--out", type=user_path, help="output directory (created if needed); default: report/ beside the runs")
    p.add_argument("--wandb-project", metavar="ENTITY/PROJECT", help="also read this W&B project (online API)")
    p.add_argument("--optuna-storage", metavar="URL", help="draw this Optuna storage's study (history, importance)")
    p.add_argument("--optuna-study", metavar="NAME", help="the study in --optuna-storage (default: the only one)")
    p.add_argument("--into", type=user_path, metavar="PAGE",
                   help="also put results_section.md into this docs page, between its '<!-- begin PATH -->' and "
                        "'<!-- end PATH -->' lines (PATH: the section file relative to the page)")
    p.add_argument("--reference", default=compare.REFERENCE, metavar="ROW",
                   help="the row every other row is compared with in the results section (default: full_precision)")
    p.add_argument("--margin", action="append", default=[], type=_margin, metavar="OUTCOME=VALUE",
                   help="an equivalence margin for 'similar' (TOST), in the outcome's units, e.g. discovery=12; "
                        f"outcomes: {', '.join(compare.OUTCOMES)}")
    p.add_argument("--no-figures", action="store_true", help="write the tables and the section, no figures")
    p.add_argument("--pdf", action="store_true", help="also write each figure as PDF (PNG alone by default)")
    p.add_argument("--smooth", type=_positive, default=figures.SMOOTH, metavar="K",
                   help=f"moving average over K steps of every curve, the unsmoothed means drawn faint beside it "
                        f"(default {figures.SMOOTH}; 1: none)")
    return p


def default_out(paths: list[str]) -> Path:
    """`report/` in the deepest folder common to `paths` (their parts before any glob) that is not a run."""
    if not paths:
        return Path("runs") / "report"
    roots = []
    for arg in paths:
        parts = Path(arg).parts
        fixed = parts[:next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))]
        root = Path(*fixed) if fixed else Path(".")
        roots.append(str((root if root.is_dir() else root.parent).resolve()))
    base = Path(os.path.commonpath(roots))
    while (base / "config.json").exists() and base != base.parent:  # a run directory: report beside it
        base = base.parent
    return base / "report"


def _runs_report(loaded, notes: list[str]) -> str:
    lines = ["# Runs", "", "## Used", "", "| run | strategy | seed | steps | source |", "|---|---|---|---|---|"]
    for r in sorted(loaded.runs, key=lambda r: (r.strategy or "~", str(r.seed), r.source)):
        lines.append(f"| {r.name} | {r.strategy or '-'} | {r.seed} | {len(r.history)} | `{r.source}` |")
    lines += ["", "## Skipped (failed, unfinished, missing or partial metrics, unreadable)", ""]
    lines += [f"- `{src}`: {why}" for src, why in loaded.skipped] or ["- none"]
    lines += ["", "## Notes", ""]
    lines += [f"- {n}" for n in (*loaded.notes, *notes)] or ["- none"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m analysis`; Ctrl-C ends it in one line."""
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        print("error: interrupted (a report being written may be partial: rerun the command)", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    tolerate_closed_pipes()
    if argv[:1] == ["wandb-report"]:  # python -m analysis wandb-report --help
        try:
            from analysis import wandb_report  # an optional extra
        except ImportError as e:
            print(f"error: wandb-report needs wandb-workspaces ({e}); pip install 'qerl-exp[dashboards]'", file=sys.stderr)
            return 2
        return wandb_report.main(argv[1:])
    if argv[:1] == ["determinism"]:
        return determinism.main(argv[1:])
    if argv[:1] == ["keep"]:
        return keep.main(argv[1:])
    args = _parser().parse_args(argv)
    if not args.paths and not args.wandb_project:
        _parser().error("give at least one PATH or --wandb-project")
    args.out = args.out or default_out(args.paths)
    try:  # what can be checked before the runs are read
        _check_out(args.out)
        if args.optuna_storage:
            args.optuna_storage = expand_sqlite(args.optuna_storage, "--optuna-storage")
            figures.check_storage(args.optuna_storage, args.optuna_study)
        if args.into:
            section.check_page(args.into, args.out / section.FILE)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    loaded = load(args.paths, wandb_project=args.wandb_project)
    for src, why in loaded.skipped:
        print(f"skipped {src}: {why}", file=sys.stderr)
    if not loaded.runs:
        print("error: no complete runs to analyse", file=sys.stderr)
        return 1
    rows, notes = table.build(loaded.runs)
    for note in table.base_notes(loaded.runs):
        print(f"warning: {note}", file=sys.stderr)
        notes.append(note)
    try:
        written = table.write(rows, args.out)
        formats = ("png", "pdf") if args.pdf else figures.PNG
        if not args.no_figures:
            written += figures.write_all(loaded.runs, args.out / "figures", smooth=args.smooth, formats=formats)
        if args.optuna_storage and not args.no_figures:
            paths, optuna_notes = figures.optuna_figures(args.optuna_storage, args.optuna_study, args.out / "figures",
                                                         formats)
            written += paths
            notes += optuna_notes
        elif not args.optuna_storage:
            notes.append("no --optuna-storage: Optuna figures skipped")
        (args.out / "strategy_runs.md").write_text(_runs_report(loaded, notes))
    except OSError as e:  # a full disk, mostly
        print(f"error: {os_error_line(e, '--out DIR') or f'{type(e).__name__}: {e}'}", file=sys.stderr)
        return 1
    written.append(args.out / "strategy_runs.md")
    built = section.build(loaded, args.reference, dict(args.margin))
    written.append(section.write(built, args.out, shlex.join(["python", "-m", "analysis", *argv]), section.cut_short(loaded)))
    if args.into:
        try:
            section.splice(args.into, written[-1])
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        written.append(args.into)
    print(table.to_markdown(rows).split("\n\n")[0])
    if summary := section.dose_summary(built):
        print("\n" + "\n".join(summary).rstrip())
    print(f"\n{len(loaded.runs)} runs used, {len(loaded.skipped)} skipped (see {args.out / 'strategy_runs.md'})")
    for p in written:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
