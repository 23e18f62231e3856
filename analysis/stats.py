"""The statistics of the tables: means with Student t-intervals, and the tests that compare rows.

Distributions come from scipy. Every test here is two-sided unless its name says otherwise, and
returns a p-value; `holm` adjusts a family of them.

| function | what |
| --- | --- |
| `t_interval(values)` | the mean with its two-sided t-interval over seeds (or pairs, or bases) |
| `t_test(values)` | the one-sample t-test of mean 0 (on paired differences: the paired t-test) |
| `one_sided(values)` | the one-sample t-test of mean 0 against mean > 0 |
| `welch(a, b)` | Welch's t-test of mean(a) - mean(b) = 0 (unequal variances) with its interval |
| `tost(values, margin)` | equivalence: the larger p of the two one-sided tests of mean <= -margin and >= margin |
| `holm(p_values)` | Holm's step-down adjustment of a family of p-values |
| `mde(values)` | the smallest mean a two-sided t-test of these values' spread detects with the stated power |
| `slope(x, y)` | the least-squares slope of y on x |
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy import stats as sp
from scipy.optimize import brentq

LEVEL = 0.95
# The minimum detectable effect of a contrast: the effect a two-sided test at ALPHA finds with POWER.
ALPHA, POWER = 0.05, 0.8
# Runs log float32 metrics: values that agree to this fraction are equal, and a sample that spreads
# less than this has no spread to test against.
FLOAT32 = 1e-6


@dataclass(frozen=True)
class Interval:
    """A mean with its two-sided t-interval.

    Args:
        mean: the sample mean.
        low: lower end of the interval (`nan` with fewer than two values).
        high: upper end of the interval (`nan` with fewer than two values).
        n: the number of values (seeds).
    """

    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def text(self, digits: int = 3) -> str:
        """`mean [low, high]` in fixed point; `mean (1 seed)` without an interval; `n/a` without a mean."""
        if math.isnan(self.mean):
            return "n/a"
        if math.isnan(self.low):
            return f"{fixed(self.mean, digits)} (1 seed)"
        return f"{fixed(self.mean, digits)} [{fixed(self.low, digits)}, {fixed(self.high, digits)}]"


def fixed(x: float, digits: int) -> str:
    """Fixed-point, without the sign of a value that rounds to zero ("-0.000")."""
    text = f"{x:.{digits}f}"
    return text.lstrip("-") if float(text) == 0 else text


def mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def stdev(values: list[float]) -> float:
    """Sample standard deviation (n - 1 in the denominator); `nan` below two values."""
    n = len(values)
    if n < 2:
        return math.nan
    m = mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / (n - 1))


def t_quantile(p: float, df: float) -> float:
    """The `p` quantile (p in [0.5, 1)) of Student's t distribution with `df` degrees of freedom.

    Example:
        `t_quantile(0.975, 1)` is 12.706..., `t_quantile(0.975, 10)` is 2.228...
    """
    if not 0.5 <= p < 1:
        raise ValueError(f"p must be in [0.5, 1), got {p}")
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    return float(sp.t.ppf(p, df))


def t_interval(values: list[float], level: float = LEVEL) -> Interval:
    """Mean and two-sided t-interval `mean +- t_{(1+level)/2, n-1} * s / sqrt(n)`.

    Args:
        values: one value per seed (or pair, or base).
        level: the confidence level.

    Returns:
        The interval; its ends are `nan` when there are fewer than two values.
    """
    n = len(values)
    m = mean(values)
    if n < 2:
        return Interval(m, math.nan, math.nan, n)
    half = t_quantile((1 + level) / 2, n - 1) * stdev(values) / math.sqrt(n)
    return Interval(m, m - half, m + half, n)


def _t_p(t: float, df: float, tail: str) -> float:
    """The p-value of a t statistic: `two` sided, or of the alternative `greater` / `less`."""
    if math.isnan(t) or df <= 0:
        return math.nan
    if tail == "greater":
        return float(sp.t.sf(t, df))
    if tail == "less":
        return float(sp.t.cdf(t, df))
    return float(2 * sp.t.sf(abs(t), df))


def _t_stat(values: list[float], null: float = 0.0) -> tuple[float, float]:
    """The one-sample t statistic against `null` and its degrees of freedom. A constant sample
    (equal pass@1 changes on 100 problems, say, up to float32 rounding) has no spread to test
    against: 0 when it equals the null, else nan (no p-value), never an infinite t."""
    n, s = len(values), stdev(values)
    if n < 2:
        return math.nan, 0
    diff = mean(values) - null
    if s <= FLOAT32 * max(1.0, abs(mean(values))):  # equal up to the metrics' float32 rounding
        return (0.0 if abs(diff) <= FLOAT32 * max(1.0, abs(null)) else math.nan), n - 1
    return diff / (s / math.sqrt(n)), n - 1


def t_test(values: list[float]) -> float:
    """Two-sided p-value of the one-sample t-test of mean 0 (nan below two values)."""
    return _t_p(*_t_stat(values), "two")


def one_sided(values: list[float]) -> float:
    """p-value of the one-sample t-test of mean 0 against the alternative mean > 0."""
    return _t_p(*_t_stat(values), "greater")


def welch(a: list[float], b: list[float], level: float = LEVEL) -> tuple[Interval, float]:
    """Welch's two-sample comparison of unpaired values.

    Returns:
        The interval of mean(a) - mean(b) (Welch-Satterthwaite degrees of freedom; n is len(a) +
        len(b)) and its two-sided p-value; nan ends and p with fewer than two values on a side.
    """
    diff, n = mean(a) - mean(b), len(a) + len(b)
    if len(a) < 2 or len(b) < 2:
        return Interval(diff, math.nan, math.nan, n), math.nan
    va, vb = stdev(a) ** 2 / len(a), stdev(b) ** 2 / len(b)
    se = math.sqrt(va + vb)
    if se <= FLOAT32 * max(1.0, abs(diff)):  # two constant samples: no spread to test against
        return Interval(diff, diff, diff, n), (1.0 if diff == 0 else math.nan)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile((1 + level) / 2, df) * se
    return Interval(diff, diff - half, diff + half, n), _t_p(diff / se, df, "two")


def tost(values: list[float], margin: float) -> float:
    """Equivalence of a mean to 0 within `+-margin` (two one-sided t-tests): the larger of the
    p-values of mean > -margin and of mean < margin. Below 0.05, the 90 % interval lies inside
    (-margin, margin)."""
    low = _t_p(*_t_stat(values, -margin), "greater")
    high = _t_p(*_t_stat(values, margin), "less")
    return math.nan if math.isnan(low) or math.isnan(high) else max(low, high)


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order (nan entries stay nan and do not count).

    Example:
        `holm([0.01, 0.04, 0.03])` is `[0.03, 0.06, 0.06]`.
    """
    ranked = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    out, running, m = [math.nan] * len(p_values), 0.0, len(ranked)
    for k, (p, i) in enumerate(ranked):
        running = max(running, min(1.0, (m - k) * p))
        out[i] = running
    return out


def mde_of(se: float, df: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true mean difference that a two-sided t-test at `alpha`, with standard error
    `se` and `df` degrees of freedom, rejects with probability `power` (noncentral t); nan
    without a spread (`se` 0 or nan) or without degrees of freedom."""
    if not (se > 0 and df > 0) or math.isnan(se):
        return math.nan
    crit = t_quantile(1 - alpha / 2, df)

    def rejects(effect: float) -> float:
        nc = effect / se
        low = sp.nct.cdf(-crit, df, nc)  # the far tail: nan once it underflows
        return float(sp.nct.sf(crit, df, nc)) + (0.0 if math.isnan(low) else float(low)) - power

    high = (crit + t_quantile(max(power, 0.5), df) + 1) * se
    while rejects(high) < 0:
        high *= 2
    return float(brentq(rejects, 0.0, high, xtol=se * 1e-6))


def mde(values: list[float], alpha: float = ALPHA, power: float = POWER) -> float:
    """The minimum detectable effect of a one-sample (paired) t-test over `values`: the mean that a
    two-sided test at `alpha` finds with probability `power`, given their spread (`mde_of`).

    Example:
        Ten paired differences with SD 1: `mde` is 1.00 (the normal approximation, (1.96 + 0.84) /
        sqrt(10) = 0.89, ignores the t-distribution's heavier tails at 9 degrees of freedom).
    """
    n = len(values)
    return mde_of(stdev(values) / math.sqrt(n), n - 1, alpha, power) if n >= 2 else math.nan


def slope(x: list[float], y: list[float]) -> float:
    """The least-squares slope of `y` on `x` (nan with fewer than two distinct x)."""
    if len(x) < 2:
        return math.nan
    mx, my = mean(x), mean(y)
    sxx = math.fsum((a - mx) ** 2 for a in x)
    return math.fsum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx if sxx > 0 else math.nan
