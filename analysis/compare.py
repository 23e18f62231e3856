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
| found | the first step whose count of route-B completions the route prior alone reaches with probability below 0.001 in a step (`found_count`: B sampled beyond what the base's prior produces), censored at the run's length |
| discovery | the first step whose `fork/b_share` >= 0.5 (B on half the completions: found and taken up), censored likewise |
| first_b | the first step that sampled route B (`fork/b_share` > 0), censored likewise |
| b_share_end | the share of greedy held-out replies on route B after the last step (`eval/fork/b_share`) |

Beside every contrast, the size of the treatment (`DOSES`): how far the row's sampler stood from
the reference row's at step 0, before any update, on the same (base, seed) pairs. A contrast of a
row that barely moved the policy says little about the treatment, whatever its interval:

| dose | per run, at step 0 |
| --- | --- |
| kl_0 | `quant/kl`: KL from the full-precision model to the sampler on the sampler's tokens, at the sampler's temperature (0 for a full-precision sampler at any temperature) |
| on_policy_gain_0 | `sampler/entropy`, compared as row minus reference: the on-policy entropy gain, each sampler on its own rollouts (the entropy QeRL credits with exploration) |
| log_pi_b_0 | `task=fork`: ln pi(B), the sampler's probability of opening with route B, read from its route-token entropy (`fork/route_entropy`) as a two-way choice (`route_b_probability`); the shift is exp(row minus reference) - 1 |

Each contrast also carries its minimum detectable effect (`stats.mde`): the difference its own test
(the same values, the same t) finds at alpha 0.05 with power 0.8, from the spread of the paired
differences. A row "similar" within a margin that is narrower than its minimum detectable effect
was declared so on a test that could not have seen that margin's effect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scipy import stats as sp
from scipy.optimize import brentq

from analysis.runs import Run
from analysis.stats import ALPHA, POWER, Interval, holm, mde, mean, slope, t_interval, t_test, tost, welch
from qerl_exp.rl.metrics import final_window

REFERENCE = "full_precision"
DISCOVERY_SHARE = 0.5  # route B is discovered once half of a step's completions take it
FOUND_LEVEL = 1e-3  # B is found once a step holds more B completions than the prior gives with this probability
# The sampler's treatment at step 0 each row is reported beside (the module docstring's dose table).
DOSES = ("kl_0", "on_policy_gain_0", "log_pi_b_0")


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


def found_count(prior: float, completions: int, level: float = FOUND_LEVEL) -> int:
    """The smallest count of route-B completions in a step of `completions` that the route prior
    alone reaches with probability below `level`: P(Binomial(completions, prior) >= k) < level.

    Example:
        `found_count(0.01, 32)` is 4 (the prior alone gives 4 or more in 32 with probability 0.00029).
    """
    return next(k for k in range(completions + 2) if sp.binom.sf(k - 1, completions, prior) < level)


def _completions(run: Run) -> int:
    return int(run.get("train.prompts_per_step")) * int(run.get("algo.group_size"))


def found(run: Run) -> tuple[int, bool]:
    """The first step whose route-B completions reach `found_count` of the run's route prior and
    completions a step (`task=fork`); censored at the run's length."""
    n = _completions(run)
    share = found_count(float(run.get("task.route_b_prior")), n) / n
    return first_step(run, "fork/b_share", share - 0.5 / n)  # b_share is a count over n, logged in float32


def route_b_probability(entropy: float) -> float:
    """pi(B) from the entropy of a route token whose mass lies on A and B: the p in (0, 0.5] with
    -p ln p - (1 - p) ln(1 - p) = `entropy` (nan outside (0, ln 2]). The fork warm-up trains the route
    token onto A and B (`rl.routes`); mass on other tokens adds its own entropy, so this reads
    pi(B) slightly high (on one base, 0.0104 for an exact 0.0101)."""
    if not 0 < entropy <= math.log(2):
        return math.nan
    return brentq(lambda p: -p * math.log(p) - (1 - p) * math.log1p(-p) - entropy, 1e-12, 0.5, xtol=1e-15)


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
        "found": float(found(run)[0]) if fork else math.nan,
        "discovery": float(discovery(run)[0]) if fork else math.nan,
        "first_b": float(first_step(run, "fork/b_share", 0.0, strict=True)[0]) if fork else math.nan,
        "b_share_end": _last(run, "eval/fork/b_share"),
    }


def dose_values(run: Run) -> dict[str, float]:
    """The run's sampler at step 0 (`DOSES`; nan where the run did not log it). `on_policy_gain_0` is
    the run's own `sampler/entropy`: a gain once the reference row's is subtracted (`doses`)."""
    pi_b = route_b_probability(_at_step_0(run, "fork/route_entropy"))
    return {"kl_0": _at_step_0(run, "quant/kl"), "on_policy_gain_0": _at_step_0(run, "sampler/entropy"),
            "log_pi_b_0": math.log(pi_b) if pi_b > 0 else math.nan}


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
        mde: the minimum detectable effect of the test behind `p` (`stats.mde`; nan for Welch).
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
    mde: float = math.nan
    p_holm: float = field(default=math.nan)

    def verdict(self, alpha: float = ALPHA, digits: int = 3) -> str:
        """`higher` / `lower` than the reference (Holm-adjusted p < alpha), `similar` (TOST p <
        alpha, with the test's minimum detectable effect beside the margin), else `not shown`."""
        if self.p_holm < alpha:
            return "higher" if self.difference.mean > 0 else "lower"
        if self.equivalence_p < alpha:
            return f"similar (+-{self.margin:g}; MDE {self.mde:.{digits}f})"
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
                    equivalence_p=tost(tested, margin) if not math.isnan(margin) else math.nan, margin=margin,
                    mde=mde(tested))


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
    "entropy_gain_0": ("same-token entropy gain at step 0", 4),
    "entropy_gain": ("same-token entropy gain (training mean)", 4),
    "heldout_pass1": ("held-out pass@1 (end)", 3),
    "ood_pass1": ("out-of-template pass@1 (end)", 3),
    "found": ("B found above the prior (step)", 1),
    "discovery": ("discovery time, B on half (steps)", 1),
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


@dataclass
class Dose:
    """How far a row's sampler stood from the reference row's at step 0 (`DOSES`), over their pairs.

    Args:
        kl: the row's `quant/kl` at step 0, mean over its runs [t-interval].
        on_policy: the on-policy entropy gain, row minus reference `sampler/entropy` (a `Contrast`).
        log_pi_b: row minus reference ln pi(B) (a `Contrast`; None outside `task=fork`).
    """

    kl: Interval
    on_policy: Contrast | None
    log_pi_b: Contrast | None

    def pi_b_shift(self) -> Interval | None:
        """The relative shift of pi(B), exp(difference) - 1, with its interval's ends mapped alike."""
        if self.log_pi_b is None:
            return None
        d = self.log_pi_b.difference
        return Interval(math.expm1(d.mean), math.expm1(d.low), math.expm1(d.high), d.n)

    def text(self) -> str:
        """The dose in one cell: `KL 0.0013; H +0.0004; pi(B) +1.4 %`."""
        parts = [f"KL {self.kl.mean:.4f}" if not math.isnan(self.kl.mean) else "KL n/a"]
        if self.on_policy is not None:
            parts.append(f"H {self.on_policy.difference.mean:+.4f}")
        if (shift := self.pi_b_shift()) is not None:
            parts.append(f"pi(B) {100 * shift.mean:+.1f} %")
        return "; ".join(parts)


def doses(rows: dict[str, list[Run]], reference: str = REFERENCE) -> dict[str, Dose]:
    """Every row's dose against the reference row (`Dose`), by label; the reference's own included."""
    if reference not in rows:
        return {}
    values = {label: {unit(r): dose_values(r) for r in runs} for label, runs in rows.items()}

    def against(label: str, name: str) -> Contrast | None:
        mine = {u: v[name] for u, v in values[label].items()}
        ref = {u: v[name] for u, v in values[reference].items()}
        if all(math.isnan(v) for v in mine.values()) or all(math.isnan(v) for v in ref.values()):
            return None
        return contrast(label, name, mine, ref)

    return {label: Dose(t_interval([v["kl_0"] for v in values[label].values() if not math.isnan(v["kl_0"])]),
                        against(label, "on_policy_gain_0"), against(label, "log_pi_b_0"))
            for label in rows}


def doses_markdown(rows: dict[str, list[Run]], reference: str = REFERENCE) -> list[str]:
    """The size of each row's treatment at step 0 against the reference (`DOSES`), one table."""
    found = doses(rows, reference)
    if not found:
        return []
    fork = any(d.log_pi_b is not None for d in found.values())
    lines = [f"**The treatment at step 0** (each row's sampler before any update, against `{reference}` on the same "
             "(base, seed) pairs; across bases as the contrasts below, the interval over the pairs beside it; "
             "`analysis/compare.py`, `DOSES`): KL from full precision to the sampler on its tokens (`quant/kl`, at "
             "the sampler's temperature: 0 for a full-precision sampler at any temperature), the on-policy entropy "
             "gain (row minus reference `sampler/entropy`, each sampler on its own rollouts)"
             + (", and the shift of pi(B), the sampler's probability of opening with route B (from the route "
                "token's entropy as a two-way choice)" if fork else "") + ":", "",
             "| row | KL to full precision [95 % CI] | on-policy entropy gain [95 % CI] | over the pairs [95 % CI] |"
             + (" pi(B) shift [95 % CI] | over the pairs [95 % CI] |" if fork else ""),
             "|---|---|---|---|" + ("---|---|" if fork else "")]
    for label, d in found.items():
        if label == reference:
            continue
        gain = d.on_policy
        cells = [label, d.kl.text(4), gain.difference.text(4) if gain else "n/a",
                 gain.over_pairs.text(4) if gain and gain.over_pairs else ""]
        if fork:
            shift, pairs = d.pi_b_shift(), d.log_pi_b.over_pairs if d.log_pi_b else None
            pct = lambda iv: (f"{100 * iv.mean:+.1f} % [{100 * iv.low:+.1f}, {100 * iv.high:+.1f}]"  # noqa: E731
                              if iv and not math.isnan(iv.low) else (f"{100 * iv.mean:+.1f} %" if iv else "n/a"))
            cells += [pct(shift), pct(Interval(math.expm1(pairs.mean), math.expm1(pairs.low), math.expm1(pairs.high),
                                               pairs.n)) if pairs else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def contrasts_markdown(rows: dict[str, list[Run]], outcomes, reference: str = REFERENCE,
                       margins: dict[str, float] | None = None) -> list[str]:
    """The paired contrasts of every row against the reference, one Markdown table over `outcomes`
    (each outcome one Holm family), each beside its minimum detectable effect and the row's dose
    at step 0 (`Dose.text`); empty without a reference row or without another row."""
    margins = margins or {}
    found = [(name, contrasts(rows, name, reference, margins.get(name, math.nan))) for name in outcomes]
    found = [(name, family) for name, family in found if family]
    if not found:
        return []
    dosed = doses(rows, reference)
    stated = ", ".join(f"{OUTCOMES[k][0]} +-{v:g}" for k, v in margins.items() if k in dict(found))
    lines = [f"**Paired contrasts against `{reference}`** (row minus reference, per (base, seed) pair; with pairs "
             "on two bases or more, across bases: each base's mean difference, their mean, 95 % t-interval and "
             "p-value over bases, the interval over the pairs beside it; Welch where the runs do not pair; Holm "
             f"over each outcome's rows; MDE: the difference the same test finds with power {POWER:g} at alpha "
             f"{ALPHA:g}; the dose: the row's sampler at step 0, KL to full precision, on-policy entropy gain H"
             + (" and pi(B)'s shift" if any(d.log_pi_b for d in dosed.values()) else "") + "; `analysis/compare.py`"
             + (f"; equivalence margins (TOST): {stated}" if stated else "") + "):", "",
             "| outcome | row | units | difference [95 % CI] | over the pairs [95 % CI] | p | Holm p | MDE | verdict "
             "| dose at step 0 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, family in found:
        label, digits = OUTCOMES[name]
        for c in family:
            pairs = c.over_pairs.text(digits) if c.over_pairs is not None else ""
            size = "n/a" if math.isnan(c.mde) else f"{c.mde:.{digits}f}"
            dose = dosed[c.row].text() if c.row in dosed else ""
            lines.append(f"| {label} | {c.row} | {_units_text(c)} | {c.difference.text(digits)} | {pairs} | "
                         f"{p_text(c.p)} | {p_text(c.p_holm)} | {size} | {c.verdict(digits=digits)} | {dose} |")
    return lines


# The doses a response is drawn against (`dose_response`): name -> (what the table calls it, the
# per-run value of `dose_values`, whether the dose is the log ratio of the row's mean to the reference's
# (else their difference)).
RESPONSE_DOSES = {
    "pi_b": ("ln pi(B) ratio", "log_pi_b_0", True),
    "kl": ("KL to full precision (nats)", "kl_0", False),
    "on_policy": ("on-policy entropy gain (nats)", "on_policy_gain_0", False),
}


@dataclass
class DoseResponse:
    """An outcome against a dose over the rows, replicated over bases (`dose_response`).

    Args:
        outcome: the outcome's name (`found` or `discovery`).
        dose: the dose's name (`RESPONSE_DOSES`).
        slopes: each base's least-squares slope of the response on the dose, by base.
        points: each base's (row, dose, response) points.
        slope: the mean of the base slopes with its 95 % t-interval over bases.
        p: its two-sided p-value.
        mde: the smallest slope that test finds with power 0.8 at alpha 0.05.
    """

    outcome: str
    dose: str
    slopes: dict
    points: dict
    slope: Interval
    p: float
    mde: float


def dose_response(rows: dict[str, list[Run]], outcome: str, reference: str = REFERENCE,
                  dose: str = "pi_b") -> DoseResponse | None:
    """`task=fork`: how an event time follows the rows' treatment at step 0.

    On each base, for every row but the reference, over the base's seeds that both rows ran: the
    response y = ln(restricted mean of `outcome` of the row's runs / the reference's), and the dose x,
    for `pi_b` ln(mean pi(B) of the row's runs / the reference's), for `kl` and `on_policy` the row's
    mean minus the reference's (`RESPONSE_DOSES`). The base's slope is the least-squares slope of y on
    x (for `pi_b` an elasticity: -1 when the time scales as 1 / pi(B), 0 when the dose does not
    matter); the estimate is the mean of the base slopes with its t-interval over bases. None with
    fewer than two bases of three rows or more (a row whose restricted mean is 0 is left out).
    """
    if reference not in rows:
        return None
    _, key, ratio = RESPONSE_DOSES[dose]
    by_base: dict = {}
    for label, runs in rows.items():
        for r in runs:
            value = dose_values(r)[key]
            by_base.setdefault(unit(r)[0], {}).setdefault(label, {})[unit(r)[1]] = (
                math.exp(value) if ratio else value, outcome_values(r)[outcome])
    slopes, points = {}, {}
    for base, labels in sorted(by_base.items(), key=lambda kv: repr(kv[0])):
        ref = labels.get(reference, {})
        pts = []
        for label, seeds in labels.items():
            common = [s for s in seeds if s in ref]
            if label == reference or not common:
                continue
            xs = (mean([seeds[s][0] for s in common]), mean([ref[s][0] for s in common]))
            ys = (mean([seeds[s][1] for s in common]), mean([ref[s][1] for s in common]))
            if any(math.isnan(v) for v in (*xs, *ys)) or min(ys) <= 0 or (ratio and min(xs) <= 0):
                continue
            pts.append((label, math.log(xs[0] / xs[1]) if ratio else xs[0] - xs[1], math.log(ys[0] / ys[1])))
        if len(pts) >= 3 and not math.isnan(b := slope([x for _, x, _ in pts], [y for _, _, y in pts])):
            slopes[base], points[base] = b, pts
    if len(slopes) < 2:
        return None
    values = list(slopes.values())
    return DoseResponse(outcome, dose, slopes, points, t_interval(values), t_test(values), mde(values))


def dose_response_markdown(rows: dict[str, list[Run]], reference: str = REFERENCE,
                           outcomes=("found", "discovery")) -> list[str]:
    """The dose-response of route B's discovery (`dose_response`): each outcome against pi(B)'s shift,
    then against the other doses; empty when the rows do not allow one."""
    found = [d for name in outcomes for dose in RESPONSE_DOSES
             if (d := dose_response(rows, name, reference, dose)) is not None]
    if not found:
        return []
    lines = [f"**Discovery against the dose** (`task=fork`; rows against `{reference}`, per base: the least-squares "
             "slope of ln(the row's restricted mean step / the reference's) on the row's dose at step 0, over the "
             "rows: ln(the row's mean pi(B) / the reference's), or the row's mean KL to full precision or on-policy "
             "entropy gain minus the reference's; the mean of the base slopes, 95 % t-interval over bases; against "
             "pi(B), -1: the time scales as 1 / pi(B), 0: the dose does not matter; `analysis/compare.py`, "
             "`dose_response`):", "",
             "| outcome | dose | bases | rows a base | slope [95 % CI] | p | MDE | each base's slope |",
             "|---|---|---|---|---|---|---|---|"]
    for d in found:
        per = ", ".join(f"{b}: {v:.2f}" for b, v in d.slopes.items())
        sizes = sorted({len(p) for p in d.points.values()})
        count = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        lines.append(f"| {OUTCOMES[d.outcome][0]} | {RESPONSE_DOSES[d.dose][0]} | {len(d.slopes)} | {count} "
                     f"| {d.slope.text(2)} | {p_text(d.p)} | {'n/a' if math.isnan(d.mde) else f'{d.mde:.2f}'} | {per} |")
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
    """`task=fork`: per row, its pi(B) at step 0; when B was found (`found`: more B completions in a
    step than the prior gives) and when it reached half the completions (`discovery`): how many runs
    got there, the median and restricted mean step; the first step that sampled B; the greedy
    replies on B after the last step. Empty for rows of other tasks."""
    fork = {label: runs for label, runs in rows.items() if runs and runs[0].series("fork/b_share")[0]}
    if not fork:
        return []
    sizes = sorted({(float(r.get("task.route_b_prior")), _completions(r)) for runs in fork.values() for r in runs})
    rule = "; ".join(f"{found_count(p, n)} of {n} at prior {p:g}" for p, n in sizes)
    lines = ["**Discovery of route B** (`task=fork`): B found, the first step with more completions on route B than "
             f"the prior alone gives in a step with probability {FOUND_LEVEL:g} ({rule}); B on half, the first step "
             f"whose completions are at least {DISCOVERY_SHARE:.0%} on route B; a run that never got there counts at "
             "its length in the restricted mean (censored) and as never in the median; pi(B) at step 0 from the "
             "route token's entropy; mean over runs [95 % t-interval]:", "",
             "| row | runs | pi(B) at step 0 | B found: runs | median step | restricted mean step | B on half: runs | "
             "median step | restricted mean step | first step sampling B: median | greedy replies on B (end) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, runs in fork.items():
        pi = t_interval([math.exp(v) for r in runs if not math.isnan(v := dose_values(r)["log_pi_b_0"])])
        cells = [label, str(len(runs)), pi.text(4)]
        for times in ([found(r) for r in runs], [discovery(r) for r in runs]):
            cells += [f"{sum(ok for _, ok in times)} of {len(runs)}", median_time(times),
                      t_interval([float(t) for t, _ in times]).text(1)]
        first = [first_step(r, "fork/b_share", 0.0, strict=True) for r in runs]
        greedy = t_interval([v for r in runs if not math.isnan(v := outcome_values(r)["b_share_end"])])
        lines.append("| " + " | ".join([*cells, median_time(first), greedy.text(2)]) + " |")
    return lines
