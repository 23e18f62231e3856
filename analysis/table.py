"""The strategy table: measured ratios to full precision beside the paper's claims.

One row per strategy preset (`conf/strategy/`), averaged over seeds. Per run (definitions):

| quantity | per run, from `metrics.jsonl` |
| --- | --- |
| weight memory | max over steps of `mem/weights_bytes` |
| peak memory | max over steps of `mem/peak_bytes` |
| rollout tokens/s | mean of `perf/rollout_tok_s` over steps 1.. (step 0 is warm-up; all steps if only one) |
| step time | mean of `perf/step_s` over steps 1.. (same rule) |
| sampler entropy | mean of `sampler/entropy` over all steps (the on-policy entropy: each sampler on its own rollouts) |
| same-token entropy gain | mean of `entropy_gain` over the steps that logged it (monitor steps): the sampler's entropy minus full precision's on the sampler's tokens |
| same-token entropy gain at step 0 | `entropy_gain` at step 0: the quantization error (and stage 0's noise, none for decaying schedules) before any update |
| final reward | mean of `reward` over the last quarter of the steps (`metrics.final_window`: `reward/final` of `summary.json`) |
| held-out pass@1 | the last `eval/pass@1` logged (`eval.every`; n/a for runs without one) |

Per strategy: the mean over seeds; memory, tokens/s and step time also as the ratio of that mean
to the full_precision mean; sampler entropy, same-token entropy gain, final reward and held-out pass@1 with a
95% Student t-interval across seeds. Only runs whose settings, apart from the strategy's own keys
(`runs.STRATEGY_KEYS`), equal those of the full_precision runs enter the table, one run per
(base, seed) and strategy: the first in the order of the command's PATHs.

Claims are judged by tests, not by where a mean falls: "slight" needs a one-sided t-test of the
runs' same-token entropy gains above 0 (p < 0.05), "significant" a 95 % interval above 0, "similar to X" an
equivalence test (TOST, p < 0.05) of the paired differences from X's runs within +-`SIMILAR_MARGIN`
of X's mean gain. Speed claims are judged only on fixed-length workloads (`rollout.ignore_eos=true`:
tokens/s over replies of different lengths compares lengths), memory claims only on runs that ran on
CUDA (on the CPU the embedded model's weights are mostly its embedding and adapters, and the process
peak is the runtime's); otherwise the claim reads "not testable here". `compare.contrasts` gives
every row's paired difference from full_precision (`contrasts_markdown`).
"""

from __future__ import annotations

import csv
import io
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from analysis import compare
from analysis.runs import STRATEGY_KEYS, Run, differences, settings
from analysis.stats import Interval, mean, mde, one_sided, t_interval, tost
from qerl_exp.rl.metrics import final_window

BASELINE = "full_precision"
FOUR_WAY = ("full_precision", "nvfp4_rollout", "nvfp4_lora", "nf4_dq")
EXTRAS = ("nf4_lora", "mxfp4_lora", "nvfp4_lora_noaqn", "bf16_aqn")

# A claim holds within these tolerances: memory reduction within 5 points below the claim, speed
# within 5% below it.
MEMORY_TOLERANCE = 0.05
SPEED_TOLERANCE = 0.05
# "Similar to X": the paired differences of entropy gain from X's runs lie within +-25 % of X's mean gain (TOST).
SIMILAR_MARGIN = 0.25
ALPHA = 0.05
NOT_TESTABLE = "not testable here"
# the outcomes whose paired contrasts against full_precision follow the table
TABLE_OUTCOMES = ("final_reward", "entropy_gain_0", "entropy_gain", "heldout_pass1")


@dataclass(frozen=True)
class Claim:
    """What is claimed for a strategy, against full precision.

    Args:
        memory_reduction: the fraction of full-precision memory saved (0.75 = "75% less").
        speedup: rollout tokens/s over full precision.
        exploration: the claimed exploration (entropy gain): "slight" or "significant" increase, or
            "similar" to that of the strategy `similar_to`.
        similar_to: the strategy whose entropy gain a "similar" claim is compared with.
        paper_weights_ratio: weights over bf16 measured in the paper at 7B (docs/method.md, section 4).
        paper_speedup: rollout tokens/s over bf16 LoRA measured in the paper at 7B, batch 8.
    """

    memory_reduction: float | None = None
    speedup: float | None = None
    exploration: str | None = None
    similar_to: str | None = None
    paper_weights_ratio: float | None = None
    paper_speedup: float | None = None


# The comparison the harness was built to check. The paper's 7B measurements (docs/method.md, section 4):
# weights 15.2 GB bf16, 5.9 GB NVFP4, 5.7 GB NF4; rollout tokens/s 1641 BF16 LoRA, 2092 QeRL,
# 1362 QLoRA. "Similar to NVFP4" is read against NVFP4 + LoRA, the other LoRA-on-4-bit strategy.
CLAIMS = {
    "nvfp4_rollout": Claim(memory_reduction=0.75, speedup=1.5, exploration="slight"),
    "nvfp4_lora": Claim(memory_reduction=0.85, speedup=1.5, exploration="significant",
                        paper_weights_ratio=5.9 / 15.2, paper_speedup=2092 / 1641),
    "nf4_dq": Claim(memory_reduction=0.80, speedup=1.3, exploration="similar", similar_to="nvfp4_lora",
                    paper_weights_ratio=5.7 / 15.2, paper_speedup=1362 / 1641),
}
CLAIMS_SOURCE = (
    "Claims: the comparison this harness checks (docs/method.md, section 4): NVFP4 only (nvfp4_rollout) "
    "-75% memory, 1.5x faster, slight exploration increase; NVFP4 + LoRA (nvfp4_lora) -85%, 1.5x, "
    "significant increase; double quant (nf4_dq) -80%, 1.3x, exploration similar to NVFP4 (read as "
    "nvfp4_lora). Paper 7B: the QeRL paper's measurements on one H100 (arXiv 2510.11696, as summarized in "
    "docs/method.md): weights 15.2 GB bf16, 5.9 GB NVFP4, 5.7 GB NF4; rollout tokens/s at batch 8: 1641 "
    "BF16 LoRA, 2092 QeRL, 1362 QLoRA. A memory claim holds when the measured weight-memory reduction is "
    "at most 5 points below it, a speed claim when rollout tokens/s over full precision is at most 5% "
    "below it, judged only on fixed-length workloads (rollout.ignore_eos=true) and, for memory, on CUDA runs "
    "(else 'not testable here'); 'slight' holds when a one-sided t-test puts the same-token entropy gain above 0 (p < 0.05), "
    "'significant' when its 95% t-interval across seeds lies above 0, 'similar to X' when an equivalence test "
    "(TOST, p < 0.05) puts the paired differences from X's entropy gains within +-25% of X's mean gain (the margin "
    "beside the verdict, with the minimum detectable effect of those differences at power 0.8, alpha 0.05)."
)


@dataclass
class Row:
    """One strategy's measured values (means over seeds) and its claim."""

    strategy: str
    seeds: int
    weights_bytes: float
    peak_bytes: float
    rollout_tok_s: float
    step_s: float
    sampler_entropy: Interval
    entropy_gain: Interval
    final_reward: Interval
    heldout_pass1: Interval
    weights_ratio: float = math.nan
    peak_ratio: float = math.nan
    tok_s_ratio: float = math.nan
    step_s_ratio: float = math.nan
    claim: Claim = field(default_factory=Claim)
    entropy_gain_0: Interval = field(default_factory=lambda: Interval(math.nan, math.nan, math.nan, 0))
    # each run's entropy gain by (base, seed), and those of the strategy a "similar" claim names
    gains: dict = field(default_factory=dict)
    peer_gains: dict | None = None
    # whether the runs can test a speed claim (fixed-length replies) and a memory claim (CUDA)
    speed_testable: bool = True
    memory_testable: bool = True
    runs: list[Run] = field(default_factory=list, repr=False)

    @property
    def memory_holds(self) -> bool | None:
        if self.claim.memory_reduction is None or math.isnan(self.weights_ratio) or not self.memory_testable:
            return None
        return 1 - self.weights_ratio >= self.claim.memory_reduction - MEMORY_TOLERANCE

    @property
    def speed_holds(self) -> bool | None:
        if self.claim.speedup is None or math.isnan(self.tok_s_ratio) or not self.speed_testable:
            return None
        return self.tok_s_ratio >= self.claim.speedup * (1 - SPEED_TOLERANCE)

    def _similar(self) -> tuple[list[float], float]:
        """The paired differences from the peer's entropy gains and the "similar" margin ([] without pairs)."""
        # a run without the noise monitor has no entropy gain (nan): it pairs with nothing
        mine = {u: g for u, g in self.gains.items() if not math.isnan(g)}
        peer = {u: g for u, g in (self.peer_gains or {}).items() if not math.isnan(g)}
        common = [u for u in mine if u in peer]
        if len(common) < 2:
            return [], math.nan
        return [mine[u] - peer[u] for u in common], SIMILAR_MARGIN * abs(mean(list(peer.values())))

    @property
    def similar_p(self) -> float:
        """TOST p-value of the paired differences from the peer's entropy gains (nan: no pairs)."""
        diffs, margin = self._similar()
        return tost(diffs, margin) if diffs else math.nan

    @property
    def similar_text(self) -> str:
        """The "similar" claim's margin beside the minimum detectable effect of its paired differences."""
        diffs, margin = self._similar()
        return f" (+-{margin:.4f}; MDE {mde(diffs):.4f})" if diffs else ""

    @property
    def exploration_holds(self) -> bool | None:
        if self.claim.exploration is None or math.isnan(self.entropy_gain.mean):
            return None
        if self.claim.exploration == "slight":
            p = one_sided(list(self.gains.values()))
            return None if math.isnan(p) else p < ALPHA
        if self.claim.exploration == "similar":
            p = self.similar_p
            return None if math.isnan(p) else p < ALPHA
        return not math.isnan(self.entropy_gain.low) and self.entropy_gain.low > 0


def run_values(run: Run) -> dict[str, float]:
    """The per-run quantities of the table (see the module docstring for their definitions)."""
    h = run.history
    timed = h[1:] if len(h) > 1 else h
    gains = [r["entropy_gain"] for r in h if r.get("entropy_gain") is not None]
    rewards = [r["reward"] for r in h]
    evals = [r["eval/pass@1"] for r in h if r.get("eval/pass@1") is not None]
    return {
        "weights_bytes": max(r["mem/weights_bytes"] for r in h),
        "peak_bytes": max(r["mem/peak_bytes"] for r in h),
        "rollout_tok_s": mean([r["perf/rollout_tok_s"] for r in timed]),
        "step_s": mean([r["perf/step_s"] for r in timed]),
        "sampler_entropy": mean([r["sampler/entropy"] for r in h]),
        "entropy_gain": mean(gains),
        "entropy_gain_0": compare.outcome_values(run)["entropy_gain_0"],
        "final_reward": mean(rewards[-final_window(len(rewards)):]),
        "heldout_pass1": evals[-1] if evals else math.nan,
    }


def select(runs: list[Run]) -> tuple[dict[str, list[Run]], list[str]]:
    """Group the runs that belong in the table by strategy; explain every run left out.

    The table compares strategies under equal settings: the reference settings are those of a
    full_precision run (when their settings differ, the ones most other runs share), or the most
    common settings when no full_precision run exists. One run per strategy and (base, seed) is
    kept: the first in the order given (the command's PATHs), never the one whose folder sorts first.
    """
    notes = []
    labelled = [r for r in runs if r.strategy is not None]
    for r in runs:
        if r.strategy is None:
            notes.append(f"{r.source}: not an instance of a strategy preset (ablation run?); not in the table")
    if not labelled:
        return {}, notes
    keyed = {r.source: tuple(sorted((k, repr(v)) for k, v in settings(r, STRATEGY_KEYS).items())) for r in labelled}
    counts = Counter(keyed.values())
    candidates = [keyed[r.source] for r in labelled if r.strategy == BASELINE] or list(counts)
    reference = dict(max(candidates, key=lambda c: (counts[c], candidates.count(c))))
    groups: dict[str, list[Run]] = {}
    seen = set()
    for r in labelled:
        mine = {k: repr(v) for k, v in settings(r, STRATEGY_KEYS).items()}
        diffs = differences(mine, reference)
        if diffs:
            notes.append(f"{r.source}: settings differ from the {BASELINE} runs ({'; '.join(diffs[:3])}); not in the table")
        elif (r.strategy, compare.unit(r)) in seen:
            notes.append(f"{r.source}: a second run of {r.strategy} with seed {r.seed}; only the first is used")
        else:
            seen.add((r.strategy, compare.unit(r)))
            groups.setdefault(r.strategy, []).append(r)
    return groups, notes


def order(names) -> list[str]:
    """Strategy names in table order: the four-way comparison, the extras, then any others."""
    known = [n for n in (*FOUR_WAY, *EXTRAS) if n in names]
    return known + sorted(n for n in names if n not in known)


def build(runs: list[Run]) -> tuple[list[Row], list[str]]:
    """The table's rows, in the order four-way, extras, others; and notes on left-out runs.

    Example:
        .. code-block:: python

            from analysis import runs, table

            rows, notes = table.build(runs.load(["runs/strategies"]).runs)
            print(table.to_markdown(rows))
            table.write(rows, "report")  # strategy_table.md, .csv, .tex
    """
    groups, notes = select(runs)
    rows = []
    for name in order(groups):
        values = [run_values(r) for r in groups[name]]
        col = {k: [v[k] for v in values] for k in values[0]}
        rows.append(Row(
            strategy=name, seeds=len(values),
            weights_bytes=mean(col["weights_bytes"]), peak_bytes=mean(col["peak_bytes"]),
            rollout_tok_s=mean(col["rollout_tok_s"]), step_s=mean(col["step_s"]),
            sampler_entropy=t_interval(col["sampler_entropy"]),
            entropy_gain=t_interval(col["entropy_gain"]),
            final_reward=t_interval(col["final_reward"]),
            heldout_pass1=t_interval(col["heldout_pass1"]),
            claim=CLAIMS.get(name, Claim()),
            entropy_gain_0=t_interval(col["entropy_gain_0"]),
            gains={compare.unit(r): v["entropy_gain"] for r, v in zip(groups[name], values)},
            speed_testable=all(r.get("rollout.ignore_eos") is True for r in groups[name]),
            memory_testable=all(r.summary.get("device") == "cuda" for r in groups[name]),
            runs=groups[name],
        ))
    base = next((r for r in rows if r.strategy == BASELINE), None)
    if base is None:
        notes.append(f"no {BASELINE} runs: the ratio columns are empty")
    else:
        for r in rows:
            r.weights_ratio = r.weights_bytes / base.weights_bytes
            r.peak_ratio = r.peak_bytes / base.peak_bytes
            r.tok_s_ratio = r.rollout_tok_s / base.rollout_tok_s
            r.step_s_ratio = r.step_s / base.step_s
    by_name = {r.strategy: r for r in rows}
    for r in rows:
        if r.claim.similar_to in by_name:
            r.peer_gains = by_name[r.claim.similar_to].gains
    return rows, notes


def base_notes(runs: list[Run]) -> list[str]:
    """A note when runs of one embedded base (`model.warmup.seed`) started from more than one
    warmed-up model (their summaries' `warmup/weights` differ): the rows then compare models as
    well as strategies. Runs of different bases differ on purpose (a study's replication)."""
    by_base: dict = {}
    for r in runs:
        if "warmup/weights" in r.summary:
            by_base.setdefault(r.get("model.warmup.seed", 0) or 0, {}).setdefault(r.summary["warmup/weights"], []).append(r.name)
    notes = []
    for base, digests in by_base.items():
        if len(digests) < 2:
            continue
        listed = "; ".join(f"{digest} ({len(names)} runs, e.g. {names[0]})" for digest, names in digests.items())
        notes.append(f"the runs{f' of base {base}' if len(by_base) > 1 else ''} started from {len(digests)} different "
                     f"warmed-up models (warmup/weights: {listed}): another kind of CPU warms up another model; "
                     "copy one machine's model.cache_dir to the others to compare strategies alone")
    return notes


# --------------------------------------------------------------------------- formatting

COLUMNS = [
    "strategy", "seeds",
    "weights_bytes", "weights_ratio", "memory_claim", "memory_holds", "paper_7b_weights_ratio",
    "peak_bytes", "peak_ratio",
    "rollout_tok_s", "tok_s_ratio", "speed_claim", "speed_holds", "paper_7b_speedup",
    "step_s", "step_s_ratio",
    "sampler_entropy", "sampler_entropy_ci_low", "sampler_entropy_ci_high",
    "entropy_gain_0", "entropy_gain_0_ci_low", "entropy_gain_0_ci_high",
    "entropy_gain", "entropy_gain_ci_low", "entropy_gain_ci_high", "exploration_claim", "exploration_holds",
    "final_reward", "final_reward_ci_low", "final_reward_ci_high",
    "heldout_pass1", "heldout_pass1_ci_low", "heldout_pass1_ci_high",
]


def _record(r: Row) -> dict:
    c = r.claim
    return {
        "strategy": r.strategy, "seeds": r.seeds,
        "weights_bytes": r.weights_bytes, "weights_ratio": r.weights_ratio,
        "memory_claim": c.memory_reduction, "memory_holds": r.memory_holds,
        "paper_7b_weights_ratio": c.paper_weights_ratio,
        "peak_bytes": r.peak_bytes, "peak_ratio": r.peak_ratio,
        "rollout_tok_s": r.rollout_tok_s, "tok_s_ratio": r.tok_s_ratio,
        "speed_claim": c.speedup, "speed_holds": r.speed_holds, "paper_7b_speedup": c.paper_speedup,
        "step_s": r.step_s, "step_s_ratio": r.step_s_ratio,
        "sampler_entropy": r.sampler_entropy.mean, "sampler_entropy_ci_low": r.sampler_entropy.low,
        "sampler_entropy_ci_high": r.sampler_entropy.high,
        "entropy_gain_0": r.entropy_gain_0.mean, "entropy_gain_0_ci_low": r.entropy_gain_0.low,
        "entropy_gain_0_ci_high": r.entropy_gain_0.high,
        "entropy_gain": r.entropy_gain.mean, "entropy_gain_ci_low": r.entropy_gain.low,
        "entropy_gain_ci_high": r.entropy_gain.high,
        "exploration_claim": _exploration(c), "exploration_holds": r.exploration_holds,
        "final_reward": r.final_reward.mean, "final_reward_ci_low": r.final_reward.low,
        "final_reward_ci_high": r.final_reward.high,
        "heldout_pass1": r.heldout_pass1.mean, "heldout_pass1_ci_low": r.heldout_pass1.low,
        "heldout_pass1_ci_high": r.heldout_pass1.high,
    }


def _exploration(c: Claim) -> str | None:
    return f"similar to {c.similar_to}" if c.exploration == "similar" else c.exploration


def to_csv(rows: list[Row]) -> str:
    """Every number at full precision (`repr`), empty cells for none; booleans as true/false."""
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        rec = _record(r)
        w.writerow({k: _csv_cell(v) for k, v in rec.items()})
    return out.getvalue()


def _csv_cell(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, float) else str(v)


# Placeholders for the times sign and the minus sign, filled in per output format.
_TIMES, _MINUS = "\x00T", "\x00M"


def _x(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.2f}{_TIMES}"


def _verdict(holds: bool | None, testable: bool = True) -> str:
    if not testable:
        return f": {NOT_TESTABLE}"
    return "" if holds is None else (": holds" if holds else ": fails")


def _cells(r: Row) -> list[str]:
    c = r.claim
    memory = "" if c.memory_reduction is None else \
        f"{_MINUS}{c.memory_reduction:.0%}{_verdict(r.memory_holds, r.memory_testable)}"
    speed = "" if c.speedup is None else f"{c.speedup:g}{_TIMES}{_verdict(r.speed_holds, r.speed_testable)}"
    explore = "" if c.exploration is None else f"{_exploration(c)}{_verdict(r.exploration_holds)}" + (
        r.similar_text if c.exploration == "similar" else "")
    paper = "; ".join(x for x in (
        "" if c.paper_weights_ratio is None else f"weights {c.paper_weights_ratio:.2f}{_TIMES}",
        "" if c.paper_speedup is None else f"tok/s {c.paper_speedup:.2f}{_TIMES}") if x)
    return [
        r.strategy, str(r.seeds),
        _x(r.weights_ratio), memory, _x(r.peak_ratio),
        _x(r.tok_s_ratio), speed, _x(r.step_s_ratio),
        r.sampler_entropy.text(), r.entropy_gain_0.text(4), r.entropy_gain.text(4), explore, r.final_reward.text(),
        r.heldout_pass1.text(), paper,
    ]


HEADERS = [
    "strategy", "seeds", "weight mem. / FP", "claimed", "peak mem. / FP", "rollout tok/s / FP", "claimed",
    "step time / FP", "sampler entropy [95% CI]", "same-token entropy gain at step 0 [95% CI]",
    "same-token entropy gain [95% CI]",
    "claimed", "final reward [95% CI]",
    "held-out pass@1 [95% CI]", "paper 7B",
]


def to_markdown(rows: list[Row]) -> str:
    """A GitHub Markdown table, then the claims' source and a table of absolute values."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for r in rows:
        cells = [c.replace(_TIMES, "x").replace(_MINUS, "-") for c in _cells(r)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", CLAIMS_SOURCE, "", _absolute_markdown(rows)]
    contrasts = compare.contrasts_markdown({r.strategy: r.runs for r in rows}, TABLE_OUTCOMES)
    if contrasts:
        lines += ["", *contrasts]
    return "\n".join(lines) + "\n"


def _absolute_markdown(rows: list[Row]) -> str:
    lines = ["| strategy | weights (MiB) | peak (MiB) | rollout tok/s | step time (s) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.strategy} | {r.weights_bytes / 2**20:.3f} | {r.peak_bytes / 2**20:.1f} | "
                     f"{r.rollout_tok_s:.1f} | {r.step_s:.3f} |")
    return "Absolute values (means over seeds):\n\n" + "\n".join(lines)


def _tex(s: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("_", r"\_"), ("%", r"\%"), ("&", r"\&"), ("#", r"\#")):
        s = s.replace(a, b)
    return s.replace(_TIMES, r"$\times$").replace(_MINUS, "$-$")


def to_latex(rows: list[Row]) -> str:
    """A `booktabs` tabular (needs `\\usepackage{booktabs}`), extras below a rule."""
    body = []
    for i, r in enumerate(rows):
        if i and r.strategy not in FOUR_WAY and rows[i - 1].strategy in FOUR_WAY:
            body.append(r"\midrule")
        body.append(" & ".join(_tex(c) for c in _cells(r)) + r" \\")
    return "\n".join([
        r"\begin{tabular}{l" + "r" * (len(HEADERS) - 1) + "}",
        r"\toprule", " & ".join(_tex(h) for h in HEADERS) + r" \\", r"\midrule",
        *body, r"\bottomrule", r"\end{tabular}",
    ]) + "\n"


def write(rows: list[Row], out_dir: Path) -> list[Path]:
    """Write `strategy_table.md`, `.csv` and `.tex` into `out_dir`; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for suffix, text in ((".md", to_markdown(rows)), (".csv", to_csv(rows)), (".tex", to_latex(rows))):
        name = "strategy_table" + suffix
        (out_dir / name).write_text(text)
        paths.append(out_dir / name)
    return paths
