"""The analysis command: run loading and checks, the strategy table, the figures, W&B readers.

The table test recomputes every cell from the `metrics.jsonl` files with its own code (the
`statistics` module and a printed t-table), never through `analysis`' helpers. Synthetic runs
cover the table and figure logic; real tiny runs (marked slow) cover the whole command.
"""

from __future__ import annotations

import copy
import csv
import json
import math
import statistics
import subprocess
import sys
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, SUBPROCESS_ENV

from scipy import stats as scipy_stats

from analysis import figures, runs as R, stats, table

FOUR_WAY = ["full_precision", "nvfp4_rollout", "nvfp4_lora", "nf4_dq"]
STRATEGIES = [*FOUR_WAY, "nf4_lora", "mxfp4_lora", "nvfp4_lora_noaqn", "bf16_aqn"]
FIGURES = ["fig4_reward", "fig5_entropy", "fig8_aqn", "fig9_15_schedules", "fig10_lora_rank", "fig16_17_lr"]

# Student t 0.975 quantiles from a printed table (df: value), for the independent recomputation.
T975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 9: 2.2622, 29: 2.0452}


# --------------------------------------------------------------------------- synthetic runs

_COMPOSED: dict[tuple, dict] = {}


def _config(strategy: str, seed: int, overrides: tuple[str, ...] = ()) -> dict:
    """A resolved config as `train.run` writes it, for a strategy preset plus overrides."""
    from qerl_exp.config.compose import compose
    from qerl_exp.config import as_dict

    key = (strategy, overrides)
    if key not in _COMPOSED:
        _COMPOSED[key] = as_dict(compose([f"strategy={strategy}", "train.steps=20", "monitor.every=2", *overrides])[0])
    config = copy.deepcopy(_COMPOSED[key])
    config["seed"] = seed
    config["choices"] = {"strategy": strategy, "quant": "x"}
    return config


def _metrics(strategy: str, seed: int, steps: int = 20, every: int = 2) -> list[dict]:
    rng = np.random.default_rng([zlib.crc32(strategy.encode()), seed])
    weights = {"full_precision": 4e6, "bf16_aqn": 4e6, "nvfp4_rollout": 5.1e6, "nf4_dq": 1.1e6}.get(strategy, 1.3e6)
    rows = []
    for s in range(steps):
        row = {
            "step": s,
            "reward": float(rng.uniform(0, 2.2)),
            "entropy": float(rng.uniform(0.1, 0.5)),
            "sampler/entropy": float(rng.uniform(0.1, 0.6)),
            "noise/sigma": 0.0 if s < 2 else 1e-2 * 0.9 ** s,
            "noise/stage": s // 2,
            "perf/rollout_tok_s": float(rng.uniform(100, 400)),
            "perf/step_s": float(rng.uniform(1, 3)),
            "mem/weights_bytes": weights,
            "mem/peak_bytes": 5e8 + 1e6 * s + 1e5 * seed,
        }
        if s % every == 0:
            row["entropy_gain"] = float(rng.normal(0.01, 0.02))
        if s % 7 == 6:  # eval.every=7: steps 6 and 13, not the last
            row["eval/pass@1"] = float(rng.uniform(0, 1))
        rows.append(row)
    return rows


def _write_run(path: Path, config: dict, rows: list[dict], finished: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        (path / "summary.json").write_text(json.dumps({"reward/final": rows[-1]["reward"]}))
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """Eight strategies x 2 seeds, four broken runs, and ablation runs, under one parent."""
    root = tmp_path_factory.mktemp("synthetic")
    good: dict[str, list[Path]] = defaultdict(list)
    for strategy in STRATEGIES:
        for seed in (0, 1):
            good[strategy].append(_write_run(root / strategy / f"s{seed}", _config(strategy, seed), _metrics(strategy, seed)))
    broken = {}
    rows = _metrics("nvfp4_lora", 7)
    del rows[3]
    broken["missing_step"] = _write_run(root / "nvfp4_lora" / "s7", _config("nvfp4_lora", 7), rows)
    rows = _metrics("nvfp4_lora", 8)
    rows[5]["reward"] = None  # the tracker writes NaN as null
    broken["null_reward"] = _write_run(root / "nvfp4_lora" / "s8", _config("nvfp4_lora", 8), rows)
    broken["unfinished"] = _write_run(root / "nf4_dq" / "s9", _config("nf4_dq", 9), _metrics("nf4_dq", 9), finished=False)
    rows = _metrics("full_precision", 6)
    del rows[4]["entropy_gain"]  # a monitor step without the monitor's metric
    broken["no_gain"] = _write_run(root / "full_precision" / "s6", _config("full_precision", 6), rows)
    ablations = {}
    for name, strategy, overrides in (
        ("fp_lr", "full_precision", ("train.lr=1e-3",)),
        ("q_lr", "nvfp4_lora", ("train.lr=1e-3",)),
        ("q_r32", "nvfp4_lora", ("lora=r32",)),
        ("q_linear", "nvfp4_lora", ("noise=linear",)),
    ):
        for seed in (0, 1):
            ablations.setdefault(name, []).append(
                _write_run(root / "ablation" / name / f"s{seed}", _config(strategy, seed, overrides), _metrics(name, seed)))
    return root, good, broken, ablations


# --------------------------------------------------------------------------- independent recomputation


def _expected(good: dict[str, list[Path]]) -> dict[str, dict]:
    """Every table cell from the metrics.jsonl files, by the definitions in analysis/table.py."""
    per_strategy = {}
    for strategy, dirs in good.items():
        per_run = []
        for d in dirs:
            rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
            later = rows[1:]
            k = math.ceil(len(rows) / 4)  # the last quarter, as summary.json's reward/final
            per_run.append({
                "weights": max(r["mem/weights_bytes"] for r in rows),
                "peak": max(r["mem/peak_bytes"] for r in rows),
                "tok_s": statistics.fmean(r["perf/rollout_tok_s"] for r in later),
                "step_s": statistics.fmean(r["perf/step_s"] for r in later),
                "sampler_entropy": statistics.fmean(r["sampler/entropy"] for r in rows),
                "gain": statistics.fmean(r["entropy_gain"] for r in rows if "entropy_gain" in r),
                "final": statistics.fmean(r["reward"] for r in rows[-k:]),
                "pass1": ([r["eval/pass@1"] for r in rows if "eval/pass@1" in r] or [math.nan])[-1],
            })
        cell = {"seeds": len(per_run), "gains": [p["gain"] for p in per_run]}
        for name in per_run[0]:
            values = [p[name] for p in per_run]
            if any(math.isnan(v) for v in values):  # held-out pass@1 of runs that never evaluated
                cell[name] = (math.nan, math.nan, math.nan)
                continue
            m = statistics.fmean(values)
            half = T975[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))
            cell[name] = (m, m - half, m + half)
        per_strategy[strategy] = cell
    fp = per_strategy["full_precision"]
    for cell in per_strategy.values():
        for name in ("weights", "peak", "tok_s", "step_s"):
            cell[name + "_ratio"] = cell[name][0] / fp[name][0]
    return per_strategy


def _check_csv(out: Path, expected: dict[str, dict]) -> list[dict]:
    rows = list(csv.DictReader((out / "strategy_table.csv").open()))
    assert [r["strategy"] for r in rows] == [s for s in STRATEGIES if s in expected]
    # the comparison the harness checks (analysis.table.CLAIMS); these runs ran on no GPU and sampled replies
    # of free length, so memory and speed claims are not testable: no verdict
    claims = {"nvfp4_rollout": (0.75, 1.5, "slight"), "nvfp4_lora": (0.85, 1.5, "significant"), "nf4_dq": (0.80, 1.3, "similar")}
    for row in rows:
        e = expected[row["strategy"]]
        assert int(row["seeds"]) == e["seeds"]
        pairs = {
            "weights_bytes": e["weights"][0], "peak_bytes": e["peak"][0], "rollout_tok_s": e["tok_s"][0],
            "step_s": e["step_s"][0], "weights_ratio": e["weights_ratio"], "peak_ratio": e["peak_ratio"],
            "tok_s_ratio": e["tok_s_ratio"], "step_s_ratio": e["step_s_ratio"],
            "sampler_entropy": e["sampler_entropy"][0], "entropy_gain": e["gain"][0], "final_reward": e["final"][0],
            "heldout_pass1": e["pass1"][0],
        }
        for col, want in pairs.items():
            if math.isnan(want):  # no held-out evaluation in these runs
                assert row[col] == "", (row["strategy"], col, row[col])
                continue
            assert math.isclose(float(row[col]), want, rel_tol=1e-9), (row["strategy"], col, row[col], want)
        # Interval ends: the printed t-table has 4-5 significant digits.
        for col, (_, lo, hi) in (("sampler_entropy", e["sampler_entropy"]), ("entropy_gain", e["gain"]),
                                 ("final_reward", e["final"]), ("heldout_pass1", e["pass1"])):
            if math.isnan(lo):
                assert row[f"{col}_ci_low"] == row[f"{col}_ci_high"] == ""
                continue
            assert math.isclose(float(row[f"{col}_ci_low"]), lo, rel_tol=1e-4, abs_tol=1e-4)
            assert math.isclose(float(row[f"{col}_ci_high"]), hi, rel_tol=1e-4, abs_tol=1e-4)
        _, _, explore = claims.get(row["strategy"], (None, None, None))
        gains = e["gains"]
        if explore is None:
            want_explore = ""
        elif explore == "slight":  # a one-sided t-test of the runs' gains above 0
            want_explore = str(scipy_stats.ttest_1samp(gains, 0.0, alternative="greater").pvalue < 0.05).lower()
        elif explore == "similar":  # TOST of the paired differences from nvfp4_lora within 25 % of its mean gain
            diffs = np.subtract(gains, expected["nvfp4_lora"]["gains"])
            margin = 0.25 * abs(np.mean(expected["nvfp4_lora"]["gains"]))
            p = max(scipy_stats.ttest_1samp(diffs, -margin, alternative="greater").pvalue,
                    scipy_stats.ttest_1samp(diffs, margin, alternative="less").pvalue)
            want_explore = str(p < 0.05).lower()
        else:
            want_explore = str(e["gain"][1] > 0).lower()
        assert (row["memory_holds"], row["speed_holds"], row["exploration_holds"]) == ("", "", want_explore)
    return rows


def _check_md_tex(out: Path, expected: dict[str, dict]) -> None:
    md = (out / "strategy_table.md").read_text()
    tex = (out / "strategy_table.tex").read_text()
    for strategy, e in expected.items():
        line = next(line for line in md.splitlines() if line.startswith(f"| {strategy} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2] == f"{e['weights_ratio']:.2f}x" and cells[4] == f"{e['peak_ratio']:.2f}x"
        assert cells[5] == f"{e['tok_s_ratio']:.2f}x" and cells[7] == f"{e['step_s_ratio']:.2f}x"
        m, lo, hi = (f"{v:.3f}".replace("-0.000", "0.000") for v in e["final"])
        assert cells[12] == f"{m} [{lo}, {hi}]"
        tex_line = next(line for line in tex.splitlines() if line.startswith(strategy.replace("_", r"\_") + " &"))
        assert f"{e['weights_ratio']:.2f}$\\times$" in tex_line and f"{m} [{lo}, {hi}]" in tex_line
    assert r"\begin{tabular}" in tex and r"\bottomrule" in tex and table.CLAIMS_SOURCE in md


# --------------------------------------------------------------------------- tests: stats and loading


@pytest.mark.parametrize("df, want", sorted(T975.items()))
def test_t_quantile_matches_the_printed_table(df, want):
    assert stats.t_quantile(0.975, df) == pytest.approx(want, abs=1e-4)


def test_t_interval_of_one_value_has_no_ends():
    iv = stats.t_interval([1.5])
    assert iv.mean == 1.5 and math.isnan(iv.low) and math.isnan(iv.high)


def test_strategy_presets_set_what_they_say():
    presets, failed = R.strategy_presets()
    assert not failed and sorted(presets) == sorted(STRATEGIES)
    want = {  # quant.format, double_quant, noise.schedule, rollout.quant, tis_cap > 0
        "full_precision": ("none", False, "none", "none", False),
        "nvfp4_rollout": ("none", False, "none", "nvfp4", True),
        "nvfp4_lora": ("nvfp4", False, "exp", "none", False),
        "nf4_dq": ("nf4", True, "none", "none", False),
        "nf4_lora": ("nf4", False, "none", "none", False),
        "mxfp4_lora": ("mxfp4", False, "none", "none", False),
        "nvfp4_lora_noaqn": ("nvfp4", False, "none", "none", False),
        "bf16_aqn": ("none", False, "exp", "none", False),
    }
    for name, p in presets.items():
        got = (p["quant.format"], p["quant.double_quant"], p["noise.schedule"], p["rollout.quant"], p["algo.tis_cap"] > 0)
        assert got == want[name], name
        assert p["lora.r"] == 16


def test_broken_runs_are_reported_and_skipped(synthetic):
    root, good, broken, _ = synthetic
    loaded = R.load([str(root)])
    used = {r.source for r in loaded.runs}
    skipped = dict(loaded.skipped)
    for why, path in broken.items():
        assert str(path) not in used and str(path) in skipped, why
    assert "logged 19 of 20 steps" in skipped[str(broken["missing_step"])]
    assert "metric reward missing or not finite" in skipped[str(broken["null_reward"])]
    assert "unfinished" in skipped[str(broken["unfinished"])]
    assert "metric entropy_gain missing" in skipped[str(broken["no_gain"])]
    assert all(str(p) in used for dirs in good.values() for p in dirs)


def test_recorded_strategy_with_an_override_is_no_instance(synthetic):
    root, _, _, ablations = synthetic
    presets, _ = R.strategy_presets()
    run = R.read_run_dir(ablations["q_r32"][0])
    notes = R.label([run], presets)
    assert run.strategy is None and "overrides lora" in notes[0]
    unrecorded = R.read_run_dir(root / "nf4_dq" / "s0")
    unrecorded.config["choices"] = {}
    R.label([unrecorded], presets)
    assert unrecorded.strategy == "nf4_dq"


def test_discover_takes_run_dirs_globs_and_wandb_files(tmp_path):
    run = _write_run(tmp_path / "a" / "run1", _config("full_precision", 0), _metrics("full_precision", 0))
    (run / "wandb" / "offline-run-x").mkdir(parents=True)
    (run / "wandb" / "offline-run-x" / "run-x.wandb").write_bytes(b":W&B")
    orphan = tmp_path / "b" / "wandb" / "offline-run-y"
    orphan.mkdir(parents=True)
    (orphan / "run-y.wandb").write_bytes(b":W&B")
    dirs, files, bad = R.discover([str(tmp_path), str(tmp_path / "a" / "run*"), str(tmp_path / "nothing*")])
    assert dirs == [run]
    assert files == [orphan / "run-y.wandb"]  # the run dir's own W&B file is not read twice
    assert bad == [(str(tmp_path / "nothing*"), "matches nothing")]


# --------------------------------------------------------------------------- tests: the table


def test_every_table_cell_matches_an_independent_recomputation(synthetic, tmp_path):
    root, good, _, _ = synthetic
    loaded = R.load([str(root)])
    rows, notes = table.build(loaded.runs)
    table.write(rows, tmp_path)
    expected = _expected(good)
    _check_csv(tmp_path, expected)
    _check_md_tex(tmp_path, expected)
    assert any("train.lr" in n and "not in the table" in n for n in notes)


@pytest.mark.slow
def test_runs_from_different_warmed_up_models_are_named_on_stderr_and_in_the_run_list(tmp_path, capsys):
    # runs made on two kinds of CPU start from two warm-ups of the embedded model: the table then
    # compares bases as well as strategies, and says so
    from analysis.__main__ import main

    def make(root, digests):
        for strategy, seed, digest in digests:
            path = _write_run(root / strategy / f"s{seed}", _config(strategy, seed), _metrics(strategy, seed))
            (path / "summary.json").write_text(json.dumps({"warmup/weights": digest, "warmup/steps": 1200}))

    make(tmp_path / "one", [(s, seed, "aaaa") for s in ("full_precision", "nvfp4_lora") for seed in (0, 1)])
    make(tmp_path / "two", [("full_precision", 0, "aaaa"), ("full_precision", 1, "bbbb"), ("nvfp4_lora", 0, "bbbb")])
    for name, warned in (("one", False), ("two", True)):
        assert main([str(tmp_path / name), "--out", str(tmp_path / f"{name}_report")]) == 0
        err = capsys.readouterr().err
        listed = (tmp_path / f"{name}_report" / "strategy_runs.md").read_text().split("## Notes")[1]
        assert ("started from 2 different warmed-up models" in err) == warned
        assert ("aaaa (1 runs" in listed and "bbbb (2 runs" in listed) == warned


def test_table_without_full_precision_leaves_ratios_empty(synthetic):
    root, _, _, _ = synthetic
    loaded = R.load([str(root / "nvfp4_lora"), str(root / "nf4_dq")])
    rows, notes = table.build(loaded.runs)
    assert [r.strategy for r in rows] == ["nvfp4_lora", "nf4_dq"]
    assert all(math.isnan(r.weights_ratio) for r in rows)
    assert "no full_precision runs" in notes[-1]
    assert ",," in table.to_csv(rows).splitlines()[1]


def _row(strategy: str, weights_ratio=math.nan, tok_s_ratio=math.nan, gain=(math.nan, math.nan, math.nan),
         gains=(), peer=None, testable=True) -> table.Row:
    """A table row with only the fields the verdicts read: `gain` is (mean, low, high), `gains` the
    runs' gains (seeds 0, 1, ...), `peer` the gains of the strategy a "similar" claim names."""
    iv = stats.Interval(*gain, n=2)
    row = table.Row(strategy=strategy, seeds=2, weights_bytes=1.0, peak_bytes=1.0, rollout_tok_s=1.0, step_s=1.0,
                    sampler_entropy=iv, entropy_gain=iv, final_reward=iv, heldout_pass1=iv, weights_ratio=weights_ratio,
                    tok_s_ratio=tok_s_ratio, claim=table.CLAIMS[strategy], gains={(0, i): g for i, g in enumerate(gains)},
                    speed_testable=testable, memory_testable=testable)
    if peer is not None:
        row.peer_gains = {(0, i): g for i, g in enumerate(peer)}
    return row


EPS = 1e-9


@pytest.mark.parametrize("strategy, reduction, speedup", [("nvfp4_rollout", 0.75, 1.5), ("nvfp4_lora", 0.85, 1.5),
                                                          ("nf4_dq", 0.80, 1.3)])
def test_memory_and_speed_verdicts_turn_at_the_claim_minus_the_tolerance(strategy, reduction, speedup):
    edge = 1 - (reduction - 0.05)  # the largest weights ratio that still holds
    assert _row(strategy, weights_ratio=edge - EPS).memory_holds is True
    assert _row(strategy, weights_ratio=edge + EPS).memory_holds is False
    assert _row(strategy, tok_s_ratio=speedup * 0.95 + EPS).speed_holds is True
    assert _row(strategy, tok_s_ratio=speedup * 0.95 - EPS).speed_holds is False
    assert _row(strategy).memory_holds is None and _row(strategy).speed_holds is None  # no full_precision runs


def test_memory_and_speed_claims_are_not_testable_on_the_cpu_or_on_replies_of_free_length():
    row = _row("nvfp4_lora", weights_ratio=0.1, tok_s_ratio=3.0, testable=False)
    assert row.memory_holds is None and row.speed_holds is None
    cells = table._cells(row)
    assert cells[3].endswith(": not testable here") and cells[6].endswith(": not testable here")


def test_slight_needs_a_one_sided_test_and_significant_an_interval_above_zero():
    assert _row("nvfp4_rollout", gain=(0.15, 0.0, 0.3), gains=(0.1, 0.2, 0.15, 0.12)).exploration_holds is True
    # a mean above 0 is not enough: one-sided p of (0.1, -0.1, 0.05) is 0.28
    assert _row("nvfp4_rollout", gain=(0.017, -1.0, 1.0), gains=(0.1, -0.1, 0.05)).exploration_holds is False
    assert _row("nvfp4_lora", gain=(1.0, EPS, 2.0)).exploration_holds is True
    assert _row("nvfp4_lora", gain=(1.0, 0.0, 2.0)).exploration_holds is False
    assert _row("nvfp4_lora", gain=(1.0, math.nan, math.nan)).exploration_holds is False  # one seed: no interval


def test_similar_is_an_equivalence_test_of_the_paired_differences():
    peer = (0.020, 0.021, 0.019, 0.020)  # margin: 25 % of 0.02
    close = (0.0201, 0.0209, 0.0192, 0.0199)  # paired differences within +-0.001 of 0
    assert _row("nf4_dq", gain=(0.02, 0.0, 0.04), gains=close, peer=peer).exploration_holds is True
    far = (0.026, 0.0275, 0.025, 0.026)  # about 0.006 above: outside the margin
    assert _row("nf4_dq", gain=(0.026, 0.0, 0.04), gains=far, peer=peer).exploration_holds is False
    noisy = (0.03, 0.01, 0.025, 0.015)  # centred on the peer but too noisy to show equivalence
    assert _row("nf4_dq", gain=(0.02, 0.0, 0.04), gains=noisy, peer=peer).exploration_holds is False
    # no verdict without the other strategy's runs to pair with
    assert _row("nf4_dq", gain=(0.02, 0.0, 0.04), gains=close).exploration_holds is None
    assert _row("nf4_dq", gain=(0.02, 0.0, 0.04), gains=close, peer=(0.02,)).exploration_holds is None


def test_similar_claim_is_judged_against_nvfp4_lora_in_the_table(synthetic):
    root, _, _, _ = synthetic
    with_peer, _ = table.build(R.load([str(root / "nvfp4_lora"), str(root / "nf4_dq")]).runs)
    dq, lora = with_peer[1], with_peer[0]
    assert dq.peer_gains == lora.gains and dq.exploration_holds is not None
    alone, _ = table.build(R.load([str(root / "nf4_dq")]).runs)
    assert alone[0].exploration_holds is None
    md = table.to_markdown(with_peer)
    assert f"similar to nvfp4_lora: {'holds' if dq.exploration_holds else 'fails'}" in md
    assert "a guess" not in md and table.CLAIMS_SOURCE in md


# --------------------------------------------------------------------------- tests: figures


@pytest.mark.slow
def test_figures_have_labelled_axes_legends_and_bands(synthetic, tmp_path, monkeypatch):
    from matplotlib.collections import PolyCollection

    root, _, _, _ = synthetic
    loaded = R.load([str(root)])
    drawn = {}
    save = figures._save

    def capture(fig, out_dir, stem, suptitle, band_note=True, formats=figures.PNG):
        drawn[stem] = [{
            "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
            "legend": [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else None,
            "bands": sum(isinstance(c, PolyCollection) for c in ax.collections),
            "curves": sum(1 for line in ax.get_lines() if not line.get_label().startswith("_")),
            "faint": sum(1 for line in ax.get_lines() if line.get_alpha() == 0.3),
        } for ax in fig.axes if ax.axison]
        return save(fig, out_dir, stem, suptitle, band_note, formats)

    monkeypatch.setattr(figures, "_save", capture)
    paths = figures.write_all(loaded.runs, tmp_path, smooth=3, formats=("png", "pdf"))
    assert sorted(drawn) == sorted(FIGURES)
    others = [s for s in STRATEGIES if s != "full_precision"]
    for stem, axes in drawn.items():
        assert any(a["legend"] for a in axes), stem
        for a in axes:
            assert a["xlabel"] == "RL step" and a["ylabel"], stem
            assert a["curves"] >= 1 and a["bands"] == a["curves"], stem  # every curve (2 seeds) has its band
            assert a["legend"] is None or len(a["legend"]) == a["curves"], stem
    # fig4: reward per strategy over each one's paired difference from full precision
    assert drawn["fig4_reward"][0]["legend"] == [f"{s} (n=2)" for s in STRATEGIES]  # table order
    assert drawn["fig4_reward"][2]["legend"] == [f"{s} (n=2)" for s in others]  # below the reward panel
    assert drawn["fig4_reward"][2]["ylabel"] == "reward - full_precision"
    assert drawn["fig4_reward"][0]["faint"] == len(STRATEGIES)  # smoothed: the raw means drawn faint
    assert drawn["fig5_entropy"][1]["legend"] == [f"{s} (n=2)" for s in STRATEGIES]
    assert "moving avg. over 3 steps" in drawn["fig5_entropy"][0]["ylabel"]
    assert drawn["fig8_aqn"][0]["legend"] == ["AQN on (exp schedule) (n=2)", "AQN off (n=2)"]
    assert drawn["fig8_aqn"][2]["legend"] == ["AQN off (n=2)"]  # against the anchor's own setting
    assert sorted(drawn["fig9_15_schedules"][0]["legend"]) == ["schedule=exp (n=2)", "schedule=linear (n=2)",
                                                               "schedule=none (n=2)"]
    assert sorted(drawn["fig10_lora_rank"][0]["legend"]) == ["alpha=16, r=16 (n=2)", "alpha=32, r=32 (n=2)"]
    assert [len(a["legend"]) for a in drawn["fig16_17_lr"][:2]] == [2, 2]  # around nvfp4_lora and full_precision
    import matplotlib.image

    for p in paths:
        if p.suffix == ".png":
            assert matplotlib.image.imread(p).shape[0] > 100
        else:
            assert p.read_bytes()[:5] == b"%PDF-"


def test_a_difference_panel_is_the_mean_paired_difference_with_its_interval(synthetic):
    root, good, _, _ = synthetic
    runs = {s: [R.read_run_dir(p) for p in good[s]] for s in ("full_precision", "nvfp4_lora")}
    d = figures.difference("nvfp4_lora", runs["nvfp4_lora"], runs["full_precision"], "reward")
    rows = {s: [[r["reward"] for r in _metrics(s, seed)] for seed in (0, 1)] for s in runs}
    for step in (0, 7, 19):
        diffs = [rows["nvfp4_lora"][k][step] - rows["full_precision"][k][step] for k in (0, 1)]
        assert d.mean[step] == pytest.approx(statistics.fmean(diffs))
        assert d.std[step] == pytest.approx(T975[1] * statistics.stdev(diffs) / math.sqrt(2), rel=1e-4)
    assert d.n == 2 and d.steps == list(range(20))


def test_smoothing_averages_steps_and_curves_that_coincide_are_named():
    assert figures._smooth([0, 1, 2, 3], [1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert figures._smooth([0, 10, 20], [1.0, 3.0, 5.0], 5) == [1.0, 3.0, 5.0]  # logged every 10 steps: untouched
    a = figures.Curve("a", [0, 1], [0.1, 0.2], [0.0, 0.0], 2)
    b = figures.Curve("b", [0, 1], [0.1, 0.2], [0.0, 0.0], 2)
    c = figures.Curve("c", [0, 1], [0.1, 0.3], [0.0, 0.0], 2)
    assert figures.coinciding([a, c, b]) == {2: "a"}
    fig, ax = figures._plt().subplots()
    figures._draw(ax, [a, c, b], "y", "t")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a (n=2)", "c (n=2)", "b (n=2) = a"]
    assert [line.get_linestyle() for line in ax.get_lines()] == ["-", "-", "--"]


def test_noise_ablation_labels_name_sigma_only_where_aqn_is_on(synthetic, tmp_path):
    root, _, _, _ = synthetic
    extra = tmp_path / "extra"
    for seed in (0, 1):  # AQN at a tenth of the preset's sigmas, beside the preset and AQN off
        _write_run(extra / f"s{seed}", _config("nvfp4_lora", seed, ("noise.sigma_start=1e-3", "noise.sigma_end=5e-5")),
                   _metrics("nvfp4_lora", seed))
    groups = figures.ablation(R.load([str(root), str(extra)]).runs, "nvfp4_lora", ("noise",))
    assert {label: len(members) for label, members in groups.items()} == {
        "schedule=exp, sigma_end=0.0005, sigma_start=0.01": 2,
        "schedule=exp, sigma_end=5e-05, sigma_start=0.001": 2,
        "schedule=linear, sigma_end=0.0005, sigma_start=0.01": 2,
        "schedule=none": 2,  # nvfp4_lora_noaqn: its unused sigmas neither split nor label it
    }


def test_optuna_history_and_importance(tmp_path):
    import optuna

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="aqn", storage=storage, direction="maximize")
    study.optimize(lambda t: t.suggest_float("sigma", 1e-4, 1e-1, log=True) * 10 - t.suggest_int("k", 2, 12) / 100,
                   n_trials=8)
    paths, notes = figures.optuna_figures(storage, None, tmp_path, formats=("png", "pdf"))
    assert sorted(p.name for p in paths) == ["optuna_history.pdf", "optuna_history.png",
                                             "optuna_importance.pdf", "optuna_importance.png"]
    assert notes == []


def test_optuna_multi_objective_and_constant_objective(tmp_path):
    import optuna

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    multi = optuna.create_study(study_name="pareto", storage=storage, directions=["maximize", "minimize"])
    multi.optimize(lambda t: (t.suggest_float("x", 0, 1), t.suggest_float("y", 0, 1)), n_trials=6)
    paths, notes = figures.optuna_figures(storage, "pareto", tmp_path / "multi")
    assert len(paths) == 2 and notes == []  # PNG alone unless PDF is asked for
    flat = optuna.create_study(study_name="flat", storage=storage)
    flat.optimize(lambda t: t.suggest_float("x", 0, 1) * 0 + 0.5, n_trials=4)
    paths, notes = figures.optuna_figures(storage, "flat", tmp_path / "flat")
    assert [p.name for p in paths] == ["optuna_history.png"]
    assert "importance is undefined" in notes[0]
    assert "2 studies" in figures.optuna_figures(storage, None, tmp_path)[1][0]


# --------------------------------------------------------------------------- tests: W&B API


class _FakeApiRun:
    def __init__(self, name, config, rows, state="finished"):
        self.name, self.id, self.state = name, name, state
        self.config = {**config, "_wandb": {}}
        self.tags = [f"strategy:{config['choices']['strategy']}"]
        self.summary = {"reward/final": 1.0, "_runtime": 3}
        self._rows = rows

    def scan_history(self):
        for row in self._rows:  # the harness logs completions tables as extra rows at a step
            yield {**row, "_step": row["step"]}
            yield {"step": row["step"], "completions": {"_type": "table-file"}}


class _FakeApi:
    def __init__(self, runs):
        self._runs = runs

    def runs(self, path):
        assert path == "me/qerl-exp"
        return self._runs


def test_wandb_project_through_the_public_api():
    cfg = _config("nf4_dq", 3)
    cfg.pop("choices")
    api = _FakeApi([_FakeApiRun("a", {**cfg, "choices": {"strategy": "nf4_dq"}}, _metrics("nf4_dq", 3)),
                    _FakeApiRun("b", _config("nf4_dq", 4), _metrics("nf4_dq", 4)[:5], state="crashed")])
    loaded = R.load([], wandb_project="me/qerl-exp", api=api)
    assert [r.source for r in loaded.runs] == ["wandb:me/qerl-exp/a"]
    assert loaded.runs[0].strategy == "nf4_dq" and len(loaded.runs[0].history) == 20
    assert loaded.skipped[0][0] == "wandb:me/qerl-exp/b" and "unfinished" in loaded.skipped[0][1]


# --------------------------------------------------------------------------- real runs (slow)

TINY = ["train.steps=3", "train.prompts_per_step=2", "algo.group_size=2", "monitor.every=1", "tracker.mode=offline"]


@pytest.fixture(scope="session")
def real_runs(tmp_path_factory):
    """The strategy command itself at tiny size: the four-way presets x 2 seeds, W&B offline."""
    out = tmp_path_factory.mktemp("strategies")
    env = {**SUBPROCESS_ENV, "SEEDS": "0 1", "STRATEGIES": " ".join(FOUR_WAY), "ABLATIONS": "0", "WANDB_MODE": "offline",
           "PYTHON": sys.executable}
    p = subprocess.run(["bash", "sweeps/strategies.sh", str(out), *TINY], cwd=ROOT, capture_output=True, text=True,
                       timeout=1800, env=env)
    assert p.returncode == 0 and "failed runs: 0" in p.stdout, (p.stdout[-2000:], p.stderr[-2000:])
    return out, {s: [out / s / f"s{seed}" for seed in (0, 1)] for s in FOUR_WAY}


@pytest.mark.slow
def test_strategy_command_writes_the_table_and_every_figure(real_runs):
    out, made = real_runs
    report = out / "report"
    for name in ("strategy_table.md", "strategy_table.csv", "strategy_table.tex", "strategy_runs.md"):
        assert (report / name).stat().st_size > 0
    for stem in FIGURES:
        assert (report / "figures" / f"{stem}.png").exists() and not (report / "figures" / f"{stem}.pdf").exists()
    expected = _expected(made)
    _check_csv(report, expected)
    _check_md_tex(report, expected)
    assert "- none" in (report / "strategy_runs.md").read_text().split("## Skipped")[1]


@pytest.mark.slow
def test_offline_wandb_file_matches_metrics_jsonl(real_runs):
    _, made = real_runs
    d = made["nvfp4_lora"][0]
    (wandb_file,) = d.glob("wandb/offline-run-*/run-*.wandb")
    from_file, from_dir = R.read_wandb_file(wandb_file), R.read_run_dir(d)
    assert from_file.finished and not R.problems(from_file)
    assert [h["step"] for h in from_file.history] == [0, 1, 2]
    for a, b in zip(from_file.history, from_dir.history):
        for name in R.REQUIRED:
            assert a[name] == pytest.approx(b[name], rel=1e-12), name
    assert from_file.config["train"] == from_dir.config["train"]
    assert from_file.summary["reward/final"] == pytest.approx(from_dir.summary["reward/final"])
    # Named alone, the file is read; beside its run directory, the directory is the source (one run, read once).
    assert R.discover([str(wandb_file)])[:2] == ([], [wandb_file])
    dirs, files, _ = R.discover([str(wandb_file), str(d.parent)])
    assert files == [] and dirs == sorted(d.parent.iterdir())


def test_keep_copies_finished_trials_records_by_config_and_seed(tmp_path, capsys):
    from analysis.__main__ import main

    sweep = tmp_path / "sweep"
    for i, (row, seed, finished) in enumerate([("fp", 0, True), ("fp", 1, True), ("q4", 0, False)]):
        config = {**_config("full_precision", seed), "choices": {"strategy": "full_precision", "config": row}}
        run = _write_run(sweep / "trials" / f"trial{i:04d}_s{seed}", config, _metrics("full_precision", seed), finished)
        (run / "eval_ood.json").write_text("{}")
        (run / "checkpoints" / "step_000010").mkdir(parents=True)
    dest = tmp_path / "kept"
    _write_run(dest / "fp_s0", _config("full_precision", 9), _metrics("full_precision", 9))  # replaced
    assert main(["keep", str(sweep), str(dest)]) == 0
    out = capsys.readouterr()
    assert "kept 2 runs" in out.out and "trial0002_s0: not finished (no summary.json)" in out.err
    assert sorted(p.name for p in dest.iterdir()) == ["fp_s0", "fp_s1"]
    for name, trial in (("fp_s0", "trial0000_s0"), ("fp_s1", "trial0001_s1")):
        assert sorted(p.name for p in (dest / name).iterdir()) == ["config.json", "eval_ood.json", "metrics.jsonl", "summary.json"]
        for f in ("config.json", "metrics.jsonl"):
            assert (dest / name / f).read_bytes() == (sweep / "trials" / trial / f).read_bytes()
    assert [r.seed for r in sorted(R.load([str(dest)]).runs, key=lambda r: r.seed)] == [0, 1]  # analysis reads them
    assert main(["keep", str(tmp_path / "nothing"), str(dest)]) == 1
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path / 'nothing'} holds no trials/*/config.json and no "
                                               "run directory; give the sweep_dir of a python -m qerl_exp.sweep run "
                                               "or a folder of runs")
