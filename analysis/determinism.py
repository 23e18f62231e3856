"""Run-to-run determinism: how far two runs of the same config and seed drift apart.

`python -m analysis determinism RUN_A RUN_B` prints, for every per-step metric both runs logged
(the machine's own measurements left out: wall times, memory peaks, `metrics.MACHINE_METRICS`),
the largest absolute difference over the steps both logged and where it is. Identical runs print
zeros. The spread bounds what a difference between seeds can mean: a seed-to-seed gap no larger
than two identical runs' is noise of the machine, not of the seed.

Example:
    python -m analysis determinism runs/study/trials/trial0000_s0 runs/repeat/full_precision_s0
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field

from analysis.runs import Run, RunError, differences, read_run_dir, same_run, settings
from qerl_exp.rl.metrics import MACHINE_METRICS
from qerl_exp.run.console import one_line_argparse


@dataclass
class Comparison:
    """Two runs of one config and seed, step by step.

    Args:
        a: the first run.
        b: the second run.
        steps: how many steps both logged.
        diffs: per metric, the largest absolute difference and the first step it occurs at.
        only_one: metrics that one run logged at a step and the other did not.
    """

    a: Run
    b: Run
    steps: int
    diffs: dict[str, tuple[float, int]] = field(default_factory=dict)
    only_one: list[str] = field(default_factory=list)

    @property
    def largest(self) -> tuple[str, float, int]:
        """The metric that differs most: (name, largest absolute difference, step)."""
        if not self.diffs:
            return "", 0.0, -1
        name = max(self.diffs, key=lambda k: self.diffs[k][0])
        return name, *self.diffs[name]

    @property
    def identical(self) -> bool:
        return not self.only_one and all(d == 0 for d, _ in self.diffs.values())


def _number(value) -> float | None:
    if value is None:  # the tracker writes NaN as null
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def compare(a: Run, b: Run) -> Comparison:
    """The largest difference per metric between two runs over the steps both logged.

    Raises:
        ValueError: the runs differ in config or seed, so they are no determinism pair.
    """
    diffs = differences(settings(a), settings(b))
    if diffs or a.seed != b.seed:
        why = "; ".join(diffs[:3]) if diffs else f"seed {a.seed} != {b.seed}"
        raise ValueError(f"{a.source} and {b.source} are not the same config and seed ({why})")
    rows_b = {h["step"]: h for h in b.history}
    out = Comparison(a, b, 0)
    only_one = set()
    for row_a in a.history:
        row_b = rows_b.get(row_a["step"])
        if row_b is None:
            continue
        out.steps += 1
        for name in (set(row_a) | set(row_b)) - {"step"}:
            if name.startswith(MACHINE_METRICS):
                continue
            if (name in row_a) != (name in row_b):
                only_one.add(name)
                continue
            x, y = _number(row_a[name]), _number(row_b[name])
            if x is None or y is None:
                continue
            d = 0.0 if (math.isnan(x) and math.isnan(y)) or x == y else abs(x - y)
            d = math.inf if math.isnan(d) else d  # one of the two is NaN
            if name not in out.diffs or d > out.diffs[name][0]:
                out.diffs[name] = (d, row_a["step"])
    out.only_one = sorted(only_one)
    return out


def to_markdown(c: Comparison, metrics: tuple[str, ...] = ()) -> str:
    """A table of the largest difference of each metric (of `metrics` only, when given), largest first."""
    names = [m for m in metrics if m in c.diffs] if metrics else sorted(c.diffs, key=lambda k: -c.diffs[k][0])
    lines = [f"`{c.a.source}` against `{c.b.source}` (seed {c.a.seed}, {c.steps} common steps): "
             + ("identical in every metric." if c.identical else "largest absolute differences:"), ""]
    if c.identical:
        return "\n".join(lines[:1]) + "\n"
    lines += ["| metric | max abs difference | first at step |", "|---|---|---|"]
    lines += [f"| {m} | {c.diffs[m][0]:.3g} | {c.diffs[m][1]} |" for m in names]
    if c.only_one:
        lines += ["", f"Logged by one run only at some step: {', '.join(c.only_one[:10])}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    """Entry point of `python -m analysis determinism RUN_A RUN_B`."""
    p = one_line_argparse(argparse.ArgumentParser(prog="python -m analysis determinism", description=__doc__.split("\n\n")[0]))
    p.add_argument("runs", nargs=2, metavar="RUN", help="two run directories of one config and seed")
    args = p.parse_args(argv)
    pair = []
    for path in args.runs:
        try:
            pair.append(read_run_dir(path))
        except RunError as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 1
    if same_run(*pair):  # it would show as identical: no determinism result
        print(f"error: {pair[0].source} and {pair[1].source} are one run (a copy or another path to it: their wall "
              "times are equal at every step); give two runs of one config and seed", file=sys.stderr)
        return 1
    try:
        comparison = compare(*pair)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(to_markdown(comparison), end="")
    return 0
