"""The results section: held-out pass@1 on both splits, why a strategy does or does not learn, the
best AQN setting, and the spread between identical runs, as one Markdown file that
results/results.md includes verbatim (`results_section.md`, written by `python -m analysis`).

Rows are the runs grouped by their settings (all but the seed and where and how a run was stored
and logged, `runs.IGNORED_KEYS`), named by the sweep config that made them (`choices.config`),
else by the folder holding them as `NAME/s<seed>` (`sweeps/strategies.sh`), else by their strategy
preset. Per run, from `metrics.jsonl`:

| quantity | per run |
| --- | --- |
| final training reward | mean `reward` over the last quarter of the steps (`reward/final` of `summary.json`) |
| pass@1 start | `eval/start/pass@1` (out of template: `eval/ood/start/pass@1`), greedy, before the first update (`eval.at_start`) |
| pass@1 end | `eval/pass@1` (`eval/ood/pass@1`) of the last step |
| change | end - start |
| quant/kl at step 0 | `quant/kl` at step 0: the sampler against the full-precision reference before any update (stage 0 of a decaying AQN schedule is noise-free: the quantization error alone) |
| quant/kl | mean `quant/kl` over the steps that logged it (`monitor.every`) |
| reply tokens, replies cut | mean `completions/mean_length` and `completions/clipped_ratio` over the last quarter of the steps |
| held-out replies cut | `eval/clipped_ratio` of the last step (greedy held-out replies cut at the length cap) |
| no reward spread | mean `frac_reward_zero_std` over all steps: groups whose completions all earned one reward, which give GRPO no signal |
| sampler-learner gap | mean `sampling/logp_gap` |

Runs cut short (a sweep stopped before their last step, each logged step whole) are in no table of
finished runs; `cut_short` compares their training reward over the last quarter of the steps all
of them logged, beside their pass@1 before the first update.

Per row: the mean over its runs (seeds, or bases x seeds) with its 95 % Student t-interval (`stats.t_interval`). Then every row
against the reference row (`--reference`, default full_precision): its treatment at step 0 (KL to
full precision, the on-policy entropy gain, for `task=fork` the shift of pi(B): `compare.DOSES`),
paired differences per (base, seed) with intervals, p-values, Holm's adjustment and the minimum
detectable effect, each beside that dose (`analysis.compare`), and for `task=fork` the discovery of
route B and its slope against pi(B)'s shift. The best AQN setting is, among the nvfp4_lora rows (settings equal to the
`nvfp4_lora` preset's outside `noise.*`; AQN off is one of them) that differ from each other in
`noise.*` alone, the one with the highest mean final training reward: chosen on training reward,
never on held-out pass@1; rows that also differ in another setting (a learning rate, a task) are
not candidates. Two runs of one row with one (base, seed) are a determinism pair: the first, in the
order of the command's PATHs (so a study named before its repeats keeps its own runs), enters the
row, and the section states their spread (`analysis.determinism`).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from analysis import compare, determinism
from analysis.runs import Loaded, Run, preset_differences, settings
from analysis.stats import Interval, mean, t_interval
from analysis.table import order
from qerl_exp.config import flatten
from qerl_exp.rl.metrics import eval_prefix, final_window
from qerl_exp.tasks.base import HELD_OUT, OOD

FILE = "results_section.md"
MIN_SEEDS = 5  # fewer runs (seeds, or bases x seeds) per row and the section says the row is too thin to conclude from
AQN_FAMILY = "nvfp4_lora"
SPLIT_NAMES = {HELD_OUT: "held-out (in template)", OOD: "out of template"}
DIAGNOSTICS = {  # column: (header, digits)
    "quant_kl_0": ("quant/kl at step 0", 3), "quant_kl": ("quant/kl", 3), "length": ("reply tokens", 1),
    "clipped": ("replies cut", 2), "eval_clipped": ("held-out replies cut (end)", 2),
    "zero_std": ("no reward spread", 2), "logp_gap": ("sampler-learner gap", 3),
}
# The outcomes whose paired contrasts against the reference row the section shows (those the runs logged).
CONTRAST_OUTCOMES = ("final_reward", "heldout_pass1", "ood_pass1", "entropy_gain_0", "entropy_gain", "found",
                     "discovery", "first_b", "b_share_end")
# Metrics a determinism pair reports besides its largest difference.
PAIR_METRICS = ("reward", "entropy", "kl", "loss", "grad_norm", "eval/pass@1", "eval/ood/pass@1")
# Settings the section names when every run shares them.
SHOWN = ("model.name", "task.name", "task.difficulty", "task.eval_size", "train.steps", "train.prompts_per_step",
         "algo.group_size", "algo.max_new_tokens", "train.lr", "lora.r", "monitor.every", "eval.every")


def _last(run: Run, metric: str, window: int | None = None) -> float:
    """The metric's mean over the last `window` steps that logged it (None: its last value)."""
    _, values = run.series(metric)
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return math.nan
    return values[-1] if window is None else mean(values[-window:])


def run_values(run: Run) -> dict[str, float]:
    """The per-run quantities of the section (the module docstring defines them)."""
    window = final_window(len(run.history))
    out = {"final_reward": _last(run, "reward", window)}
    for split in SPLIT_NAMES:
        first = run.history[0].get(eval_prefix(split, start=True) + "pass@1") if run.history else None
        start = float(first) if isinstance(first, (int, float)) else math.nan
        end_steps, end_values = run.series(eval_prefix(split) + "pass@1")
        end = end_values[-1] if end_steps and end_steps[-1] == run.history[-1]["step"] else math.nan
        out.update({f"{split}_start": start, f"{split}_end": end, f"{split}_change": end - start})
    kl0 = run.history[0].get("quant/kl") if run.history else None
    _, kl = run.series("quant/kl")
    _, zero_std = run.series("frac_reward_zero_std")
    _, gap = run.series("sampling/logp_gap")
    out.update({
        "quant_kl_0": float(kl0) if isinstance(kl0, (int, float)) else math.nan, "quant_kl": mean(kl),
        "length": _last(run, "completions/mean_length", window), "clipped": _last(run, "completions/clipped_ratio", window),
        "eval_clipped": _last(run, "eval/clipped_ratio"), "zero_std": mean(zero_std), "logp_gap": mean(gap),
    })
    return out


@dataclass
class Row:
    """One setting: its runs (one per base and seed) and each quantity over them."""

    label: str
    runs: list[Run]
    values: dict[str, Interval] = field(default_factory=dict)

    @property
    def seeds(self) -> int:
        return len(self.runs)


@dataclass
class Section:
    """What the section shows: rows, the AQN selection, determinism pairs, and notes."""

    rows: list[Row]
    candidates: list[Row]
    best: Row | None
    pairs: list[determinism.Comparison]
    notes: list[str]
    reference: str = compare.REFERENCE
    margins: dict[str, float] = field(default_factory=dict)


def _label(runs: list[Run]) -> str:
    """The sweep config that made the runs; else the folder holding them as `NAME/s<seed>` (what
    `sweeps/strategies.sh` writes); else their strategy preset."""
    configs = Counter(r.choices.get("config") for r in runs if r.choices.get("config"))
    if configs:
        return configs.most_common(1)[0][0]
    folders = {Path(r.source).parent.name for r in runs}
    if len(folders) == 1 and all(Path(r.source).name == f"s{r.seed}" for r in runs):
        return folders.pop()
    return runs[0].strategy or f"like {runs[0].name}"


def _family(run: Run, presets: dict[str, dict]) -> str | None:
    """The run's strategy preset, else the first one it equals outside `noise.*`."""
    return run.strategy or next((p for p in order(presets) if not preset_differences(run, presets[p], ignore=("noise",))), None)


def _aqn_candidates(rows: list[Row], presets: dict) -> list[Row]:
    """The nvfp4_lora-family rows that differ from each other in `noise.*` alone: the largest group
    of them sharing every other setting (the first such group in row order); none when no two do."""
    preset = presets.get(AQN_FAMILY)
    family = [r for r in rows if preset and not preset_differences(r.runs[0], preset, ignore=("noise",))]
    groups: dict[tuple, list[Row]] = {}
    for r in family:
        groups.setdefault(tuple(sorted((k, repr(v)) for k, v in settings(r.runs[0], ("noise",)).items())), []).append(r)
    largest = max(groups.values(), key=len, default=[])
    return largest if len(largest) >= 2 else []


def build(loaded: Loaded, reference: str = compare.REFERENCE, margins: dict[str, float] | None = None) -> Section:
    """Group the runs into rows, compute every quantity, pick the best AQN setting, pair repeats.

    Args:
        loaded: the runs.
        reference: the label of the row every other row is compared with.
        margins: equivalence margins by outcome (`compare.OUTCOMES`), for "similar" verdicts.
    """
    groups: dict[tuple, list[Run]] = {}
    for run in loaded.runs:  # in PATH order: the first run of a row and seed is the row's
        key = tuple(sorted((k, repr(v)) for k, v in settings(run).items()))
        groups.setdefault(key, []).append(run)
    rows, pairs, notes, seen = [], [], [], Counter()
    for runs in groups.values():
        by_seed: dict = {}
        for run in runs:
            if compare.unit(run) in by_seed:
                pairs.append(determinism.compare(by_seed[compare.unit(run)], run))
            else:
                by_seed[compare.unit(run)] = run
        label = _label(runs)
        seen[label] += 1
        row = Row(label if seen[label] == 1 else f"{label} ({seen[label]})", list(by_seed.values()))
        per_run = [run_values(r) for r in row.runs]
        row.values = {k: t_interval([v[k] for v in per_run]) for k in per_run[0]}
        rows.append(row)
    # table order by strategy preset, an AQN variant beside its preset (its noise.* aside)
    rank = {name: i for i, name in enumerate(order(loaded.presets))}
    rows.sort(key=lambda r: (rank.get(_family(r.runs[0], loaded.presets), len(rank)), r.label))
    thin = [f"{r.label} ({r.seeds})" for r in rows if r.seeds < MIN_SEEDS]
    if thin:
        notes.append(f"fewer than {MIN_SEEDS} runs, too few to conclude from: {', '.join(thin)}")
    candidates = _aqn_candidates(rows, loaded.presets)
    scored = [r for r in candidates if not math.isnan(r.values["final_reward"].mean)]
    best = max(scored, key=lambda r: r.values["final_reward"].mean) if scored else None
    for r in rows:
        if any(math.isnan(r.values[f"{s}_start"].mean) for s in SPLIT_NAMES):
            notes.append(f"{r.label}: no evaluation before the first update on some split (eval.at_start), so no change")
    if reference not in [r.label for r in rows]:
        notes.append(f"no row is labelled {reference}: no paired contrasts (--reference names the row to compare with)")
    return Section(rows, candidates, best, pairs, notes, reference, dict(margins or {}))


def _where(run: Run, runs: list[Run]) -> str:
    """The run's directory relative to the folder holding all the runs (sweeps name every run
    directory trialNNNN_sS, so names alone repeat)."""
    root = os.path.commonpath([str(Path(r.source).parent) for r in runs])
    return os.path.relpath(run.source, root)


def _commits(runs: list[Run]) -> str:
    """Where the runs were made: `at commit X`, or each commit with its count, and runs that a
    resume finished at another commit."""
    started = Counter(r.config.get("commit") or "(not recorded)" for r in runs)
    text = ", ".join(f"`{c}` ({n} runs)" for c, n in started.most_common())
    moved = [_where(r, runs) for r in runs if r.summary.get("commit") not in (None, r.config.get("commit"))]
    return (f"commit `{next(iter(started))}`" if len(started) == 1 else f"commits {text}") + (
        f"; finished at another commit: {', '.join(moved)}" if moved else "")


def _settings(runs: list[Run]) -> str:
    flats = [flatten(r.config) for r in runs]
    shared = [f"{k}={flats[0][k]}" for k in SHOWN if k in flats[0] and all(f.get(k) == flats[0][k] for f in flats)]
    return ", ".join(f"`{s}`" for s in shared)


def _change_table(rows: list[Row]) -> list[str]:
    head = ["row", "runs", "final training reward"]
    for name in SPLIT_NAMES.values():
        head += [f"{name}: start", "end", "change"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.label, str(r.seeds), r.values["final_reward"].text()]
        for split in SPLIT_NAMES:
            v = r.values
            cells += [v[f"{split}_start"].text(), v[f"{split}_end"].text(), v[f"{split}_change"].text()]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _diagnostics_table(rows: list[Row]) -> list[str]:
    head = ["row", *(h for h, _ in DIAGNOSTICS.values())]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([r.label, *(r.values[k].text(d) for k, (_, d) in DIAGNOSTICS.items())]) + " |")
    return lines


def _best(section: Section) -> list[str]:
    if section.best is None:
        return [f"No two {AQN_FAMILY} rows (settings equal to the `{AQN_FAMILY}` preset's outside `noise.*`) differ "
                "in `noise.*` alone: no AQN setting to choose."]
    b = section.best
    ranked = sorted(section.candidates, key=lambda r: -r.values["final_reward"].mean)
    rewards = ", ".join(f"{r.label} {r.values['final_reward'].text()}" for r in ranked)
    lines = [f"Chosen on the final training reward, never on held-out pass@1, among the {AQN_FAMILY} rows "
             f"({rewards}): **{b.label}**. Its change in greedy pass@1 over {b.seeds} run(s), with 95 % intervals:", ""]
    lines += [f"- {name}: {b.values[f'{split}_start'].text()} -> {b.values[f'{split}_end'].text()}, "
              f"change {b.values[f'{split}_change'].text()}" for split, name in SPLIT_NAMES.items()]
    return lines


def _pairs(section: Section) -> list[str]:
    if not section.pairs:
        return ["No two runs share a config and a seed here, so the spread between identical runs is not measured."]
    lines, everyone = [], [r for c in section.pairs for r in (c.a, c.b)] + [r for row in section.rows for r in row.runs]
    for c in section.pairs:
        name, largest, step = c.largest
        pair = f"`{_where(c.a, everyone)}` and `{_where(c.b, everyone)}` (seed {c.a.seed}"
        if c.identical:
            lines.append(f"- {pair}): identical in every per-step metric over {c.steps} steps.")
            continue
        shown = "; ".join(f"{m} {c.diffs[m][0]:.3g}" for m in PAIR_METRICS if m in c.diffs)
        lines.append(f"- {pair}, {c.steps} steps): largest difference {largest:.3g} ({name}, step {step}); {shown}.")
    return lines


def _compared(section: Section) -> list[str]:
    """Each row's dose at step 0, the paired contrasts against the reference row beside it and, for
    `task=fork`, the discovery table and discovery against the dose."""
    rows = {r.label: r.runs for r in section.rows}
    out = []
    for part in (compare.doses_markdown(rows, section.reference),
                 compare.contrasts_markdown(rows, CONTRAST_OUTCOMES, section.reference, section.margins),
                 compare.discovery_markdown(rows), compare.dose_response_markdown(rows, section.reference)):
        out += [*part, ""] if part else []
    return out


def dose_summary(section: Section) -> list[str]:
    """What `python -m analysis` prints of the section: each row's dose at step 0 and, beside it, the
    contrasts of route B's discovery (`task=fork`) or of the final training reward."""
    rows = {r.label: r.runs for r in section.rows}
    fork = any(runs and runs[0].series("fork/b_share")[0] for runs in rows.values())
    out = []
    for part in (compare.doses_markdown(rows, section.reference),
                 compare.contrasts_markdown(rows, ("found", "discovery") if fork else ("final_reward",),
                                            section.reference, section.margins),
                 compare.dose_response_markdown(rows, section.reference) if fork else []):
        out += [*part, ""] if part else []
    return out


def cut_short(loaded: Loaded) -> list[str]:
    """When some runs stopped before their last step: every run (finished or cut short; one a seed)
    grouped by settings, compared on the training reward over the last quarter of the steps that
    all of them logged, beside pass@1 before the first update."""
    if not loaded.unfinished:
        return []
    runs = sorted([*loaded.runs, *loaded.unfinished], key=lambda r: (not r.finished, r.source))
    common = min(len(r.history) for r in runs)
    first = common - final_window(common)
    groups: dict[tuple, dict] = {}
    for run in runs:
        groups.setdefault(tuple(sorted((k, repr(v)) for k, v in settings(run).items())), {}).setdefault(run.seed, run)
    cut = loaded.unfinished
    lines = [f"**Runs cut short.** {len(cut)} runs stopped before their last step (steps logged: "
             f"{min(len(r.history) for r in cut)}-{max(len(r.history) for r in cut)} of {cut[0].get('train.steps')}): "
             f"they have no end evaluation and are in no table above. Every run (one a seed, the finished ones "
             f"included) on its training reward over steps {first}-{common - 1}, the last quarter of the steps "
             f"all of them logged, against steps 0-{common - first - 1}, and its pass@1 before the first update; "
             "mean over runs [95 % t-interval]:", "",
             f"| row | runs | cut short | training reward, steps 0-{common - first - 1} | steps {first}-{common - 1} "
             "| held-out start | out of template start |", "|---|---|---|---|---|---|---|"]
    for by_seed in groups.values():
        group = list(by_seed.values())
        early = t_interval([mean([h["reward"] for h in r.history[: common - first]]) for r in group])
        reward = t_interval([mean([h["reward"] for h in r.history[first:common]]) for r in group])
        starts = [t_interval([_first(r, f"{eval_prefix(s, start=True)}pass@1") for r in group]) for s in SPLIT_NAMES]
        lines.append(f"| {_label(group)} | {len(group)} | {sum(not r.finished for r in group)} | {early.text()} | {reward.text()} "
                     f"| {starts[0].text()} | {starts[1].text()} |")
    return lines


def _first(run: Run, metric: str) -> float:
    value = run.history[0].get(metric)
    return float(value) if value is not None else math.nan


def to_markdown(section: Section, command: str, cut: list[str] | None = None) -> str:
    """The section: provenance, the pass@1 table, the diagnostics, the AQN choice, determinism, notes."""
    runs = [r for row in section.rows for r in row.runs]
    studies = sorted({r.choices.get("study") for r in runs if r.choices.get("study")})
    lines = ["<!-- written by python -m analysis (the command below); do not edit: rerun it -->", "",
             f"**Runs.** {len(runs)} runs in {len(section.rows)} rows"
             + (f", from the sweep(s) {', '.join(f'`sweeps/{s}.yaml`' for s in studies)}" if studies else "")
             + f", made at {_commits(runs)}. Shared settings: {_settings(runs)}.", "",
             f"**Made by** `{command}`.", "",
             "Greedy pass@1 on each evaluation split before the first update (start) and after the last "
             "(end), and the final training reward (mean of the last quarter of the steps); mean over runs "
             "[95 % t-interval], change = end - start per run:", "",
             *_change_table(section.rows), "",
             "Why a strategy does or does not learn (means over runs [95 % t-interval]; `analysis/section.py` "
             "defines each column): the re-quantized base's distance from the full-precision one "
             "(`quant/kl`, nats a token), reply lengths and how many hit the cap, and how many groups had no "
             "reward spread (`frac_reward_zero_std`):", "",
             *_diagnostics_table(section.rows), "",
             *_compared(section),
             "**Best AQN setting.** " + "\n".join(_best(section)), "",
             "**Identical runs.**", "", *_pairs(section)]
    if cut:
        lines += ["", *cut]
    if section.notes:
        lines += ["", "**Notes.**", "", *(f"- {n}" for n in section.notes)]
    return "\n".join(lines) + "\n"


def write(section: Section, out_dir: Path, command: str, cut: list[str] | None = None) -> Path:
    """Write `results_section.md` into `out_dir` (with `cut`, the `cut_short` table); return its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / FILE).write_text(to_markdown(section, command, cut))
    return out_dir / FILE


def markers(page: Path, section_file: Path) -> tuple[str, str]:
    """The two lines of a docs page between which a section file's text stands (its path relative
    to the page's folder)."""
    rel = Path(os.path.relpath(Path(section_file).resolve(), Path(page).resolve().parent)).as_posix()
    return f"<!-- begin {rel} -->", f"<!-- end {rel} -->"


def blocks(page: Path) -> dict[Path, str]:
    """The section files a docs page includes, each with the text between its markers."""
    lines, found = Path(page).read_text().splitlines(keepends=True), {}
    for i, line in enumerate(lines):
        if line.startswith("<!-- begin ") and line.rstrip().endswith(" -->"):
            rel = line.strip()[len("<!-- begin "):-len(" -->")]
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == f"<!-- end {rel} -->"), None)
            if end is not None:
                found[(Path(page).parent / rel).resolve()] = "".join(lines[i + 1:end])
    return found


def splice(page: Path, section_file: Path) -> None:
    """Put the section file's text between its two markers in `page`, replacing what was there.

    Raises:
        ValueError: the page lacks the markers (the message gives them).
    """
    head, begin, end, tail = _parts(page, section_file)
    Path(page).write_text(head + begin + "\n" + Path(section_file).read_text() + end + "\n" + tail)


def check_page(page: Path, section_file: Path) -> None:
    """What `splice` would refuse, before any run is read: a page that is not there, or lacks the markers.

    Raises:
        ValueError: one line naming `--into` and what to add.
    """
    _parts(page, section_file)


def _parts(page: Path, section_file: Path) -> tuple[str, str, str, str]:
    begin, end = markers(page, section_file)
    try:
        text = Path(page).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--into {page} cannot be read ({type(e).__name__}: {getattr(e, 'strerror', None) or e}); "
                         "give an existing docs page") from None
    head, sep, rest = text.partition(begin + "\n")
    _, sep2, tail = rest.partition(end + "\n")
    if not (sep and sep2):
        raise ValueError(f"{page} has no lines '{begin}' and '{end}' to put the section between; add them where it goes")
    return head, begin, end, tail
