"""Comparing rows: each row against a reference row, by paired differences.

Two runs pair when they share their unit, (base, seed): the embedded base they started from
(`model.warmup.seed`; 0 for a pretrained model) and the run seed (prompts and sampling streams).
Arms of one unit see the same prompts and the same random draws, so their difference cancels what
the prompts did. The runs of a 4-bit row on one base all sample from one quantization of one model,
so the **base** is the replication of a format's effect:

- with pairs on two bases or more, the estimate is the mean over bases of each base's mean paired
  difference, its 95 % t-interval and p-value across bases (`kind` `bases`); the interval over the
  pairs themselves is kept beside it (`pairs`), which covers this set of bases only;
- with pairs on one base, the interval over the pairs (`kind` `pairs`): the prompts' and the
  sampling's spread, not the format's;
- with fewer than two pairs, Welch's comparison of the two rows' runs (`kind` `welch`).

A table's contrasts of one outcome form one family: `holm` adjusts their p-values together.
"Similar" is an equivalence test (TOST) against a stated margin, never overlapping intervals.

Outcomes per run (`OUTCOMES`; `discovery` for `task=fork`):

| outcome | per run |
| --- | --- |
| final_reward | mean `reward` over the last quarter of the steps (`reward/final`) |
| entropy_gain_0 | `entropy_gain` at step 0: the sampler against the full-precision reference before any update |
| entropy_gain | mean `entropy_gain` over the steps that logged it |
| heldout_pass1 | the last step's `eval/pass@1` |
| ood_pass1 | the last step's `eval/ood/pass@1` (the out-of-template split) |
| discovery | the first step whose `fork/b_share` >= 0.5, a run that never gets there counted at its length (censored) |
| first_b | the first step that sampled route B (`fork/b_share` > 0), censored likewise |
| b_share_end | the share of greedy held-out replies on route B after the last step (`eval/fork/b_share`) |
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from analysis.runs import Run
from analysis.stats import Interval, holm, mean, t_interval, t_test, tost, welch
from qerl_exp.metrics import final_window

REFERENCE = "full_precision"
DISCOVERY_SHARE = 0.5  # route B is discovered once half of a step's completions take it


def unit(run: Run) -> tuple[int, object]:
    """The pairing unit of a run: (its embedded base, its seed)."""
    return run.get("model.warmup.seed", 0) or 0, run.seed


def first_step(run: Run, metric: str, above: float, strict: bool = False) -> tuple[int, bool]:
    """The first step whose `metric` is >= `above` (> with `strict`), and True; else the run's length
    (the step it would have needed at least) and False: censored."""
    for step, value in zip(*run.series(metric)):
        if value > above or (not strict and value == above):
            return step, True
    return len(run.history), False


def discovery(run: Run) -> tuple[int, bool]:
    """The step at which the run's completions are first at least half on route B (`task=fork`)."""
    return first_step(run, "fork/b_share", DISCOVERY_SHARE)


def _at_step_0(run: Run, metric: str) -> float:
    value = run.history[0].get(metric) if run.history else None
    return float(value) if isinstance(value, (int, float)) else math.nan


def _last(run: Run, metric: str) -> float:
    _, values = run.series(metric)
    return values[-1] if values else math.nan


def outcome_values(run: Run) -> dict[str, float]:
    """Every outcome of the module's table for one run (nan where the run did not log it)."""
    rewards = [h["reward"] for h in run.history if isinstance(h.get("reward"), (int, float))]
    _, gains = run.series("entropy_gain")
    fork = bool(run.series("fork/b_share")[0])
    return {
        "final_reward": mean(rewards[-final_window(len(rewards)):]) if rewards else math.nan,
        "entropy_gain_0": _at_step_0(run, "entropy_gain"),
        "entropy_gain": mean(gains),
        "heldout_pass1": _last(run, "eval/pass@1"),
        "ood_pass1": _last(run, "eval/ood/pass@1"),
        "discovery": float(discovery(run)[0]) if fork else math.nan,
        "first_b": float(first_step(run, "fork/b_share", 0.0, strict=True)[0]) if fork else math.nan,
        "b_share_end": _last(run, "eval/fork/b_share"),
    }


@dataclass
class Contrast:
    """A row's difference from the reference in one outcome.

    Args:
        row: the row's label.
        outcome: the outcome's name (`OUTCOMES`).
        kind: `bases` (across bases), `pairs` (over pairs of one base) or `welch` (unpaired).
        difference: the estimate of row - reference with its 95 % interval (`n`: bases, pairs or runs).
        p: its two-sided p-value.
        pairs: the (base, seed) pairs behind it (0 for Welch).
        bases: the bases those pairs span.
        over_pairs: with `kind` `bases`, the interval over the pairs themselves.
        equivalence_p: TOST's p-value against `margin` (nan without a margin or without pairs).
        margin: the equivalence margin, in the outcome's units (nan: none stated).
        p_holm: `p` adjusted over the family (`adjust`).
    """

    row: str
    outcome: str
    kind: str
    difference: Interval
    p: float
    pairs: int
    bases: int
    over_pairs: Interval | None = None
    equivalence_p: float = math.nan
    margin: float = math.nan
    p_holm: float = field(default=math.nan)

    def verdict(self, alpha: float = 0.05) -> str:
        """`higher` / `lower` than the reference (Holm-adjusted p < alpha), `similar` (TOST p <
        alpha), else `not shown`."""
        if self.p_holm < alpha:
            return "higher" if self.difference.mean > 0 else "lower"
        if self.equivalence_p < alpha:
            return f"similar (+-{self.margin:g})"
        return "not shown"


def contrast(row: str, outcome: str, values: dict[tuple, float], reference: dict[tuple, float],
             margin: float = math.nan) -> Contrast:
    """One row against the reference, from each run's value by unit (see the module docstring).

    Args:
        row: the row's label.
        outcome: the outcome's name.
        values: the row's value per (base, seed).
        reference: the reference row's value per (base, seed).
        margin: the equivalence margin ("similar"), or nan for none.
    """
    finite = lambda d: {u: v for u, v in d.items() if not math.isnan(v)}  # noqa: E731
    values, reference = finite(values), finite(reference)
    common = sorted(set(values) & set(reference), key=repr)
    if len(common) < 2:
        interval, p = welch(list(values.values()), list(reference.values()))
        return Contrast(row, outcome, "welch", interval, p, 0, 0, margin=margin)
    diffs = {u: values[u] - reference[u] for u in common}
    by_base: dict = {}
    for (base, _), d in diffs.items():
        by_base.setdefault(base, []).append(d)
    over_pairs = t_interval(list(diffs.values()))
    if len(by_base) >= 2:
        base_means = [mean(ds) for ds in by_base.values()]
        tested, kind, interval = base_means, "bases", t_interval(base_means)
    else:
        tested, kind, interval = list(diffs.values()), "pairs", over_pairs
    return Contrast(row, outcome, kind, interval, t_test(tested), len(common), len(by_base),
                    over_pairs=over_pairs if kind == "bases" else None,
                    equivalence_p=tost(tested, margin) if not math.isnan(margin) else math.nan, margin=margin)


def adjust(family: list[Contrast]) -> list[Contrast]:
    """Holm-adjust the p-values of one outcome's contrasts in place; return them."""
    for c, p in zip(family, holm([c.p for c in family])):
        c.p_holm = p
    return family


def contrasts(rows: dict[str, list[Run]], outcome: str, reference: str = REFERENCE,
              margin: float = math.nan) -> list[Contrast]:
    """Every row but the reference against it in one outcome, Holm-adjusted as one family.

    Args:
        rows: the runs of each row, by label.
        outcome: one of `OUTCOMES`.
        reference: the reference row's label.
        margin: the equivalence margin of the outcome (nan: no "similar" verdict).

    Returns:
        One contrast per row with a value of the outcome, in the rows' order; empty without the reference.
    """
    if reference not in rows:
        return []
    by_unit = {label: {unit(r): outcome_values(r)[outcome] for r in runs} for label, runs in rows.items()}
    if all(math.isnan(v) for v in by_unit[reference].values()):
        return []
    family = [contrast(label, outcome, by_unit[label], by_unit[reference], margin)
              for label in rows if label != reference
              and any(not math.isnan(v) for v in by_unit[label].values())]
    return adjust(family)


OUTCOMES = {  # name: (what the tables call it, digits)
    "final_reward": ("final training reward", 3),
    "entropy_gain_0": ("entropy gain at step 0", 4),
    "entropy_gain": ("entropy gain (training mean)", 4),
    "heldout_pass1": ("held-out pass@1 (end)", 3),
    "ood_pass1": ("out-of-template pass@1 (end)", 3),
    "discovery": ("discovery time (steps)", 1),
    "first_b": ("first step sampling B", 1),
    "b_share_end": ("greedy replies on B (end)", 2),
}


def p_text(p: float) -> str:
    """A p-value as the tables print it."""
    if math.isnan(p):
        return "n/a"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _units_text(c: Contrast) -> str:
    if c.kind == "welch":
        return f"Welch, {c.difference.n} runs"
    return f"{c.pairs} pairs, {c.bases} base{'s' if c.bases > 1 else ''}"


def contrasts_markdown(rows: dict[str, list[Run]], outcomes, reference: str = REFERENCE,
                       margins: dict[str, float] | None = None) -> list[str]:
    """The paired contrasts of every row against the reference, one Markdown table over `outcomes`
    (each outcome one Holm family); empty without a reference row or without another row."""
    margins = margins or {}
    found = [(name, contrasts(rows, name, reference, margins.get(name, math.nan))) for name in outcomes]
    found = [(name, family) for name, family in found if family]
    if not found:
        return []
    stated = ", ".join(f"{OUTCOMES[k][0]} +-{v:g}" for k, v in margins.items() if k in dict(found))
    lines = [f"**Paired contrasts against `{reference}`** (row minus reference, per (base, seed) pair; with pairs "
             "on two bases or more, across bases: each base's mean difference, their mean, 95 % t-interval and "
             "p-value over bases, the interval over the pairs beside it; Welch where the runs do not pair; Holm "
             "over each outcome's rows; `analysis/compare.py`"
             + (f"; equivalence margins (TOST): {stated}" if stated else "") + "):", "",
             "| outcome | row | units | difference [95 % CI] | over the pairs [95 % CI] | p | Holm p | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for name, family in found:
        label, digits = OUTCOMES[name]
        for c in family:
            pairs = c.over_pairs.text(digits) if c.over_pairs is not None else ""
            lines.append(f"| {label} | {c.row} | {_units_text(c)} | {c.difference.text(digits)} | {pairs} | "
                         f"{p_text(c.p)} | {p_text(c.p_holm)} | {c.verdict()} |")
    return lines


def median_time(times: list[tuple[int, bool]]) -> str:
    """The median of event times, a time never reached counting as later than any: `> T` when
    more than half the runs never reached it (T their length)."""
    ordered = sorted((t if reached else math.inf, t) for t, reached in times)
    n = len(ordered)
    middle = [ordered[(n - 1) // 2], ordered[n // 2]]
    if any(math.isinf(v) for v, _ in middle):
        return f"> {max(t for _, t in ordered)}"
    return f"{mean([v for v, _ in middle]):g}"


def discovery_markdown(rows: dict[str, list[Run]]) -> list[str]:
    """`task=fork`: per row, how many runs discovered route B (`fork/b_share` >= 0.5 at some step),
    the median and restricted mean discovery step, and the first step that sampled B; empty for
    rows of other tasks."""
    fork = {label: runs for label, runs in rows.items() if runs and runs[0].series("fork/b_share")[0]}
    if not fork:
        return []
    lines = [f"**Discovery of route B** (`task=fork`): the first step whose completions are at least "
             f"{DISCOVERY_SHARE:.0%} on route B; a run that never got there counts at its length in the restricted "
             "mean (censored) and as never in the median; mean over runs [95 % t-interval]:", "",
             "| row | runs | discovered | median step | restricted mean step | first step sampling B: median | "
             "greedy replies on B (end) |", "|---|---|---|---|---|---|---|"]
    for label, runs in fork.items():
        times = [discovery(r) for r in runs]
        first = [first_step(r, "fork/b_share", 0.0, strict=True) for r in runs]
        greedy = t_interval([v for r in runs if not math.isnan(v := outcome_values(r)["b_share_end"])])
        lines.append(f"| {label} | {len(runs)} | {sum(ok for _, ok in times)} of {len(runs)} | {median_time(times)} | "
                     f"{t_interval([float(t) for t, _ in times]).text(1)} | {median_time(first)} | {greedy.text(2)} |")
    return lines
