"""Live progress of a run or an evaluation: one line a researcher can watch.

On a terminal, one tqdm bar updates in place: steps done, time left, and the step's reward,
entropy, noise sigma and rollout tokens/s. When the output is a file or a pipe (a log, CI, a
sweep worker's log), a bar redrawn in place would be unreadable, so plain lines are written
instead: at the first step, then at most one every `every_s` seconds, and at the last step. Either
way the final line stays, so a finished run's output ends with its last step's numbers.

A plain line reads::

    train step 6/6 | reward 0.544 | entropy 0.412 | sigma 0 | tok/s 1873 | 14 s, 2.3 s/step

The shown values are the metrics the run logs (names from `qerl_exp.rl.metrics`).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Mapping, TextIO

from tqdm import tqdm

# (logged metric name, label, format) of the values a run's line shows.
RUN_FIELDS = (
    ("reward", "reward", ".3f"),
    ("entropy", "entropy", ".3f"),
    ("noise/sigma", "sigma", ".3g"),
    ("perf/rollout_tok_s", "tok/s", ".0f"),
)
# Seconds between plain lines when the output is not a terminal.
PLAIN_EVERY_S = 30.0


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}" if minutes >= 60 else f"{minutes}:{s:02d}"


class Progress:
    """One progress line for `total` units of work (steps of a run, sequences of an evaluation).

    Args:
        total: units the work has.
        desc: the line's label (`train`, `eval`).
        initial: units already done (a resumed run); its rate counts only the new ones.
        unit: the name of one unit.
        fields: `(metric, label, format)` of the values shown from `update`'s metrics.
        file: where the line goes; a terminal gets the in-place bar, anything else plain lines.
        every_s: seconds between plain lines (first and last units are always written).

    Example:
        >>> bar = Progress(cfg.train.steps, "train")  # doctest: +SKIP
        >>> for step in range(cfg.train.steps):  # doctest: +SKIP
        ...     bar.update(step + 1, step_metrics)  # closes itself after the last step
    """

    def __init__(self, total: int, desc: str, *, initial: int = 0, unit: str = "step",
                 fields: tuple[tuple[str, str, str], ...] = RUN_FIELDS, file: TextIO | None = None,
                 every_s: float = PLAIN_EVERY_S):
        self.total, self.desc, self.unit, self.fields = total, desc, unit, fields
        self.file = file if file is not None else sys.stderr
        self.every_s = every_s
        self.done, self.initial = initial, initial
        self.values: dict[str, float] = {}
        self.closed = False
        self._start = time.monotonic()
        self._written_at: float | None = None
        self._written_done = initial
        isatty = getattr(self.file, "isatty", None)
        self.bar = None
        if isatty is not None and isatty():
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=self.file, dynamic_ncols=True,
                            leave=True)

    def update(self, done: int, metrics: Mapping[str, float] | None = None) -> None:
        """Record that `done` units are finished, with the latest unit's metrics.

        Args:
            done: units finished so far (not an increment).
            metrics: the values to show; names missing from it keep their last value.
        """
        if self.closed:
            return
        self.done = done
        for name, _, _ in self.fields:
            value = (metrics or {}).get(name)
            if isinstance(value, (int, float)):
                self.values[name] = float(value)
        if self.bar is not None:
            self.bar.set_postfix_str(self._values_text(" ", "="), refresh=False)
            self.bar.update(done - self.bar.n)
        else:
            now = time.monotonic()
            if self._written_at is None or now - self._written_at >= self.every_s or done >= self.total:
                self._write_line(now)
        if done >= self.total:
            self.close()

    def advance(self, n: int) -> None:
        """Record `n` more finished units (for work counted in batches)."""
        self.update(self.done + n)

    def close(self) -> None:
        """End the line: the bar stays as drawn; in plain mode, progress not yet written is."""
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
        elif self.done != self._written_done:
            self._write_line(time.monotonic())

    def line(self) -> str:
        """The plain line for the current state (what a log gets)."""
        elapsed = time.monotonic() - self._start
        parts = [f"{self.desc} {self.unit} {self.done}/{self.total}"]
        values = self._values_text(" | ", " ")
        if values:
            parts.append(values)
        new = self.done - self.initial
        timing = _duration(elapsed)
        if new > 0:
            per = elapsed / new
            timing += f", {per:.1f} s/{self.unit}" if per >= 1 else f", {1 / per:.1f} {self.unit}/s"
            if self.done < self.total:
                timing += f", ~{_duration(per * (self.total - self.done))} left"
        parts.append(timing)
        return " | ".join(parts)

    def _values_text(self, sep: str, eq: str) -> str:
        shown = []
        for name, label, fmt in self.fields:
            if name in self.values:
                v = self.values[name]
                shown.append(f"{label}{eq}{format(v, fmt) if math.isfinite(v) else v}")
        return sep.join(shown)

    def _write_line(self, now: float) -> None:
        print(self.line(), file=self.file, flush=True)
        self._written_at, self._written_done = now, self.done
