"""The results section (`analysis/section.py`) and run-to-run determinism (`analysis/determinism.py`).

A synthetic study of four rows x 5 seeds, as the SmolLM2 study writes it (both evaluation splits
before the first update and at the last step, the diagnostics' metrics), and two repeated runs.
Every interval is recomputed here with the `statistics` module and a printed t-table.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
import statistics
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT
from test_analysis import T975, _config, _write_run

from analysis import __main__ as cli
from analysis import determinism, section
from analysis import runs as R

STEPS, SEEDS = 20, range(5)
# row: (strategy preset, overrides, mean training reward, mean held-out end, mean out-of-template end)
ROWS = {
    "full_precision": ("full_precision", (), 1.6, 0.8, 0.5),
    "nvfp4_lora_noaqn": ("nvfp4_lora_noaqn", (), 0.5, 0.3, 0.1),
    "nvfp4_lora_paper": ("nvfp4_lora", (), 0.3, 0.5, 0.2),  # the best held-out of the three
    "nvfp4_lora_relative": ("nvfp4_lora", ("noise.relative=true",), 0.7, 0.2, 0.1),  # the best training reward
}
START = {"heldout": 0.16, "ood": 0.05}


def _history(row: str, seed: int) -> list[dict]:
    _, _, reward, held, ood = ROWS[row]
    rng = np.random.default_rng([len(row), seed])
    rows = []
    for s in range(STEPS):
        h = {"step": s, "reward": float(reward + rng.normal(0, 0.2)), "entropy": 1.0, "sampler/entropy": 1.2,
             "noise/sigma": 0.0, "perf/rollout_tok_s": float(rng.uniform(100, 200)), "perf/step_s": float(rng.uniform(1, 3)),
             "mem/weights_bytes": 1e6, "mem/peak_bytes": 2e6, "completions/mean_length": float(rng.uniform(10, 128)),
             "completions/clipped_ratio": float(rng.uniform(0, 1)), "frac_reward_zero_std": float(rng.uniform(0, 1)),
             "sampling/logp_gap": float(rng.uniform(0, 0.5)), "kl": float(rng.uniform(0, 0.1))}
        if s % 2 == 0:  # monitor.every=2
            h["entropy_gain"], h["quant/kl"] = 0.01, float(rng.uniform(0.2, 0.3))
        rows.append(h)
    rows[0].update({"eval/start/pass@1": START["heldout"], "eval/ood/start/pass@1": START["ood"]})
    rows[9].update({"eval/pass@1": 0.99, "eval/ood/pass@1": 0.99})  # a midpoint: not the end
    rows[-1].update({"eval/pass@1": float(held + rng.normal(0, 0.05)), "eval/ood/pass@1": float(ood + rng.normal(0, 0.05)),
                     "eval/clipped_ratio": float(rng.uniform(0, 1))})
    return rows


def _run_config(row: str, seed: int, commit: str = "abc1234") -> dict:
    strategy, overrides, *_ = ROWS[row]
    config = _config(strategy, seed, ("train.steps=20", "monitor.every=2", *overrides))
    config["choices"] = {"strategy": strategy, "config": row, "study": "smollm2_study"}
    config["commit"] = commit
    return config


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """The four rows x 5 seeds, a repeat of one run (identical) and of another (one step moved),
    and one run that a resume finished at another commit."""
    root = tmp_path_factory.mktemp("study")
    for row in ROWS:
        for seed in SEEDS:
            path = _write_run(root / "trials" / f"{row}_s{seed}", _run_config(row, seed), _history(row, seed))
            commit = "abc1234" if (row, seed) != ("full_precision", 4) else "def5678"
            (path / "summary.json").write_text(json.dumps({"commit": commit}))
    repeat = _history("full_precision", 0)
    for h in repeat:  # another process: the same metrics, other wall times (equal ones would be a copy of the run)
        h["perf/step_s"] += 0.5
    _write_run(root / "trials_repeat" / "fp_s0", _run_config("full_precision", 0), repeat)
    moved = _history("nvfp4_lora_paper", 1)
    moved[7]["reward"] += 0.25
    moved[7]["perf/step_s"] += 9.0  # the machine's own measurements are not compared
    _write_run(root / "trials_repeat" / "q_s1", _run_config("nvfp4_lora_paper", 1), moved)
    return root


@pytest.fixture(scope="module")
def built(study):
    return section.build(R.load([str(study)]))


@pytest.fixture(scope="module")
def made(study, tmp_path_factory):
    """`python -m analysis` over the study, into a docs page with the section's two marker lines."""
    docs = tmp_path_factory.mktemp("docs")
    out, page = docs / "study", docs / "results.md"
    page.write_text("# Results\n\n<!-- begin study/results_section.md -->\nold text\n<!-- end study/results_section.md -->\n\nafter\n")
    assert cli.main([str(study), "--out", str(out), "--into", str(page)]) == 0
    return out, page


def _interval(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of the 95 % t-interval (the printed t-table has 5 significant digits)."""
    return statistics.fmean(values), T975[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))


def test_every_row_and_change_matches_an_independent_recomputation(built):
    assert [r.label for r in built.rows] == ["full_precision", "nvfp4_lora_paper", "nvfp4_lora_relative",
                                             "nvfp4_lora_noaqn"]  # strategy order, then name
    for row in built.rows:
        assert row.seeds == 5 and {r.name for r in row.runs} == {f"{row.label}_s{s}" for s in SEEDS}
        rows = [_history(row.label, s) for s in SEEDS]
        expected = {
            "final_reward": [statistics.fmean(h["reward"] for h in rs[-5:]) for rs in rows],  # the last quarter
            "heldout_change": [rs[-1]["eval/pass@1"] - START["heldout"] for rs in rows],
            "ood_end": [rs[-1]["eval/ood/pass@1"] for rs in rows],
            "ood_change": [rs[-1]["eval/ood/pass@1"] - START["ood"] for rs in rows],
            "quant_kl_0": [rs[0]["quant/kl"] for rs in rows],
            "quant_kl": [statistics.fmean(h["quant/kl"] for h in rs if "quant/kl" in h) for rs in rows],
            "length": [statistics.fmean(h["completions/mean_length"] for h in rs[-5:]) for rs in rows],
            "zero_std": [statistics.fmean(h["frac_reward_zero_std"] for h in rs) for rs in rows],
            "eval_clipped": [rs[-1]["eval/clipped_ratio"] for rs in rows],
        }
        for name, values in expected.items():
            got, (m, half) = row.values[name], _interval(values)
            assert got.mean == pytest.approx(m, rel=1e-12) and got.half_width == pytest.approx(half, rel=1e-4), (row.label, name)
        assert row.values["heldout_start"].mean == START["heldout"]


def test_the_best_aqn_setting_is_chosen_on_training_reward_not_held_out(built):
    # AQN off, the paper's schedule and the relative one are the nvfp4_lora rows; full precision is not
    assert sorted(r.label for r in built.candidates) == ["nvfp4_lora_noaqn", "nvfp4_lora_paper", "nvfp4_lora_relative"]
    assert built.best.label == "nvfp4_lora_relative"  # though nvfp4_lora_paper did better on held-out
    paper = next(r for r in built.rows if r.label == "nvfp4_lora_paper")
    assert paper.values["heldout_end"].mean > built.best.values["heldout_end"].mean
    text = section.to_markdown(built, "python -m analysis x")
    change = built.best.values["ood_change"]
    assert "**nvfp4_lora_relative**" in text and f"change {change.text()}" in text


@pytest.mark.slow
def test_the_section_names_its_commit_command_and_the_spread_of_identical_runs(study, built, made):
    out, page = made
    text = (out / section.FILE).read_text()
    assert f"**Made by** `python -m analysis {study} --out {out} --into {page}`." in text
    assert "20 runs in 4 rows, from the sweep(s) `sweeps/smollm2_study.yaml`, made at commit `abc1234`; " \
           "finished at another commit: full_precision_s4." in text
    assert "`train.steps=20`" in text and "`monitor.every=2`" in text
    fp = built.rows[0]
    line = next(x for x in text.splitlines() if x.startswith("| full_precision | 5 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2:6] == [fp.values["final_reward"].text(), "0.160 [0.160, 0.160]", fp.values["heldout_end"].text(),
                          fp.values["heldout_change"].text()]
    pairs = {(c.a.name, c.b.name): c for c in built.pairs}
    assert set(pairs) == {("full_precision_s0", "fp_s0"), ("nvfp4_lora_paper_s1", "q_s1")}
    assert pairs[("full_precision_s0", "fp_s0")].identical
    moved = pairs[("nvfp4_lora_paper_s1", "q_s1")]
    assert moved.largest == ("reward", pytest.approx(0.25), 7) and "perf/step_s" not in moved.diffs
    assert "`trials/full_precision_s0` and `trials_repeat/fp_s0` (seed 0): identical in every per-step metric " \
           "over 20 steps." in text
    assert "largest difference 0.25 (reward, step 7)" in text
    assert "fewer than 5 runs" not in text


def test_determinism_command_compares_two_runs_step_by_step(study, capsys):
    a, b = study / "trials" / "nvfp4_lora_paper_s1", study / "trials_repeat" / "q_s1"
    assert cli.main(["determinism", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "| reward | 0.25 | 7 |" in out and "perf/step_s" not in out
    assert cli.main(["determinism", str(a), str(study / "trials" / "nvfp4_lora_paper_s2")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "are not the same config and seed (seed 1 != 2)" in err and "\n" not in err
    assert cli.main(["determinism", str(a), str(study / "nothing")]) == 1
    assert capsys.readouterr().err.strip() == f"error: {study / 'nothing'}: no readable config.json (FileNotFoundError)"


def test_a_nan_against_a_number_is_an_infinite_difference(study):
    run = R.read_run_dir(study / "trials" / "full_precision_s1")
    other = copy.deepcopy(run)
    other.history[3]["kl"] = None  # the tracker writes NaN as null
    assert determinism.compare(run, other).diffs["kl"] == (math.inf, 3)
    assert determinism.compare(other, copy.deepcopy(other)).identical  # NaN against NaN: the same


def test_the_section_goes_into_a_page_between_its_markers(made, tmp_path):
    out, page = made
    text = page.read_text()
    assert text.startswith("# Results\n\n<!-- begin study/results_section.md -->\n<!-- written by")
    assert "old text" not in text and text.endswith("<!-- end study/results_section.md -->\n\nafter\n")
    assert section.blocks(page) == {(out / section.FILE).resolve(): (out / section.FILE).read_text()}
    bare = out.parent / "bare.md"
    bare.write_text("no markers\n")
    with pytest.raises(ValueError, match=r"bare.md has no lines '<!-- begin study/results_section.md -->' and"):
        section.splice(bare, out / section.FILE)
    assert bare.read_text() == "no markers\n"


def _pages() -> list[Path]:
    """The pages a reader opens: the design docs, the results page and the study protocols."""
    return [*sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "results").glob("*.md")),
            *sorted((ROOT / "results" / "protocols").glob("*.md"))]


def _included() -> list[tuple[Path, Path, str]]:
    return [(page, path, text) for page in _pages() for path, text in section.blocks(page).items()
            if path.name == section.FILE]


def _blocks() -> list[tuple[Path, Path, str]]:
    return [(page, path, text) for page in _pages() for path, text in section.blocks(page).items()]


@pytest.mark.parametrize("page, path, text", _blocks(), ids=[f"{p.name}:{f.parent.name}/{f.name}" for p, f, _ in _blocks()])
def test_every_block_a_page_includes_is_its_file(page, path, text):
    assert text == path.read_text(), f"{page} is out of date: include {path} again"


def test_an_included_strategy_table_is_what_its_sections_command_makes():
    """A strategy table beside a results section is made by the section's command from the same runs."""
    from analysis import table

    tables = [(page, path) for page, path, _ in _blocks() if path.name == "strategy_table.md"]
    assert tables, "results/results.md includes the CPU strategy table"
    for page, path in tables:
        command = next(x for x in (path.parent / section.FILE).read_text().splitlines()
                       if x.startswith("**Made by** `")).split("`")[1]
        args = cli._parser().parse_args(shlex.split(command)[3:])
        rows, _ = table.build(R.load([str(ROOT / p) for p in args.paths]).runs)
        assert table.to_markdown(rows) == path.read_text(), f"{path} is out of date: rerun {command}"


def _probe_tables() -> list[tuple[Path, Path, str]]:
    return [(page, path, text) for page in _pages() for path, text in section.blocks(page).items()
            if path.with_suffix(".json").is_file()]


@pytest.mark.parametrize("page, path, text", _probe_tables() or [pytest.param(None, None, None, marks=pytest.mark.skip(
    reason="no docs page includes a probe table yet"))])
def test_every_included_probe_table_is_the_table_of_its_record(page, path, text):
    """A probe table a page includes is its file, and the file is `probe.table` of the JSON record
    `python -m qerl_exp.probe ... out=` wrote beside it."""
    from qerl_exp import probe

    assert text == path.read_text(), f"{page} is out of date: include {path} again"
    assert text == probe.table(json.loads(path.with_suffix(".json").read_text())) + "\n"


_DECIMAL = re.compile(r"(?<![\d.])[-+]?(\d+\.\d+)(?![\d.])")


def _quoted(page: Path) -> tuple[list[str], set[str]]:
    """The decimal numbers a page's summaries (its `>` blockquotes) quote, and those its tables and
    included sections hold (without signs: a summary says 'lower by 0.089' of a table's -0.089)."""
    text = page.read_text()
    summaries = "\n".join(line for line in text.splitlines() if line.startswith(">"))
    sources = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    sources += "\n".join(section.blocks(page).values())
    return _DECIMAL.findall(summaries), set(_DECIMAL.findall(sources))


def test_a_summary_number_that_no_table_holds_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("> - reward rose from 0.13 to 0.237 [0.126, 0.349], lower by 0.089 (1.50x)\n\n"
                    "| row | reward | change |\n|---|---|---|\n| a | 0.237 [0.126, 0.349] | -0.089 |\n| b | 1.49x | |\n")
    quoted, held = _quoted(page)
    assert [q for q in quoted if q not in held] == ["0.13", "1.50"]


@pytest.mark.parametrize("page", [p for p in _pages() if _quoted(p)[0]])
def test_every_number_a_summary_quotes_stands_in_a_table_or_section_of_its_page(page):
    quoted, held = _quoted(page)
    missing = [q for q in quoted if q not in held]
    assert not missing, f"{page.name}'s summaries quote numbers no table or included section of it holds: {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("page, path, text", _included() or [pytest.param(None, None, None, marks=pytest.mark.skip(
    reason="no docs page includes a results section yet"))])
def test_every_included_section_is_the_current_output_of_its_command(page, path, text):
    """What a docs page shows between its markers is its section file, and the file is what its own
    command makes today from the runs kept in the repository."""
    assert text == path.read_text(), f"{page} is out of date: rerun the command in {path}"
    command = next(x for x in text.splitlines() if x.startswith("**Made by** `")).split("`")[1]
    argv = shlex.split(command)[3:]
    args = cli._parser().parse_args(argv)
    loaded = R.load([str(ROOT / p) for p in args.paths])
    built = section.build(loaded, args.reference, dict(args.margin))
    assert section.to_markdown(built, command, section.cut_short(loaded)) == text


def test_runs_cut_short_are_compared_on_the_steps_all_of_them_logged(tmp_path):
    """A study stopped early: two finished runs and three cut at steps 14-17 of one row; the section
    keeps them out of its tables and compares every run on the last quarter of the 14 steps all of
    them logged (final_window(14) = 4: steps 10-13) against its first 4 steps."""
    root = tmp_path / "trials"
    histories = {}
    for seed, steps in zip(SEEDS, (20, 20, 14, 17, 15)):
        histories[seed] = _history("full_precision", seed)[:steps]
        _write_run(root / f"fp_s{seed}", _run_config("full_precision", seed), histories[seed], finished=steps == 20)
    loaded = R.load([str(root)])
    assert len(loaded.runs) == 2 and len(loaded.unfinished) == 3
    lines = section.cut_short(loaded)
    row = next(line for line in lines if line.startswith("| full_precision"))
    late = [statistics.mean(h["reward"] for h in histories[s][10:14]) for s in SEEDS]
    early = [statistics.mean(h["reward"] for h in histories[s][:4]) for s in SEEDS]
    half = lambda xs: T975[len(xs) - 1] * statistics.stdev(xs) / math.sqrt(len(xs))  # noqa: E731
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:3] == ["5", "3"]
    for cell, values in ((cells[3], early), (cells[4], late)):
        m, lo, hi = (float(x) for x in cell.replace("[", "").replace("]", "").replace(",", "").split())
        assert m == pytest.approx(statistics.mean(values), abs=1e-3)
        assert hi - m == pytest.approx(half(values), abs=2e-3) and m - lo == pytest.approx(half(values), abs=2e-3)
    assert "steps 10-13" in lines[0] and "14-17 of 20" in lines[0]
    assert section.cut_short(R.load([str(root / "fp_s0")])) == []  # nothing cut short: no table


def test_a_row_keeps_the_run_of_the_first_path_and_pairs_the_other(study):
    """A study named before its repeats keeps its own runs in the table, whatever the folders' names."""
    def rows(paths):
        built = section.build(R.load([str(study / p) for p in paths]))
        return {r.label: {run.name for run in r.runs} for r in built.rows}, {(c.a.name, c.b.name) for c in built.pairs}

    (study_first, pairs), (repeats_first, flipped) = rows(["trials", "trials_repeat"]), rows(["trials_repeat", "trials"])
    assert "full_precision_s0" in study_first["full_precision"] and "fp_s0" not in study_first["full_precision"]
    assert "q_s1" in repeats_first["nvfp4_lora_paper"] and "nvfp4_lora_paper_s1" not in repeats_first["nvfp4_lora_paper"]
    assert pairs == {(b, a) for a, b in flipped} == {("full_precision_s0", "fp_s0"), ("nvfp4_lora_paper_s1", "q_s1")}
