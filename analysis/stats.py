"""Across-seed statistics: the mean, the sample standard deviation and Student's t-interval.

Written with the standard library alone (no scipy): the t quantile comes from integrating the t
density numerically and inverting the resulting CDF by bisection, accurate to ~1e-9.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Interval:
    """A mean over seeds with its two-sided t-interval.

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


def _t_pdf(x: float, df: float) -> float:
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))


def _t_cdf_upper(x: float, df: float) -> float:
    """P(T <= x) for x >= 0: 1/2 plus the density integrated over [0, x] by Simpson's rule."""
    # Integrate in theta = atan(u) (du = (1 + u^2) dtheta), which maps the heavy tails of small
    # df onto a bounded interval where the integrand is smooth.
    theta_max = math.atan(x)
    n = 2000  # even; the integrand is smooth in theta
    h = theta_max / n
    total = 0.0
    for i in range(n + 1):
        theta = i * h
        u = math.tan(theta)
        f = _t_pdf(u, df) * (1 + u * u)
        total += f if i in (0, n) else (4 * f if i % 2 else 2 * f)
    return 0.5 + total * h / 3


def t_quantile(p: float, df: float) -> float:
    """The `p` quantile (p in [0.5, 1)) of Student's t distribution with `df` degrees of freedom.

    Example:
        `t_quantile(0.975, 1)` is 12.706..., `t_quantile(0.975, 10)` is 2.228...
    """
    if not 0.5 <= p < 1:
        raise ValueError(f"p must be in [0.5, 1), got {p}")
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    lo, hi = 0.0, 1.0
    while _t_cdf_upper(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if _t_cdf_upper(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def t_interval(values: list[float], level: float = 0.95) -> Interval:
    """Mean and two-sided t-interval `mean +- t_{(1+level)/2, n-1} * s / sqrt(n)` over seeds.

    Args:
        values: one value per seed.
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
