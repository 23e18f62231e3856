"""Rows compared against a reference: paired differences by (base, seed), across bases, Welch where
runs do not pair, Holm, TOST, minimum detectable effects, each row's dose at step 0, and route B's
discovery with its dose-response; each checked against scipy, a simulation or by hand."""

from __future__ import annotations

import functools
import json
import math
import zlib
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sp

from analysis import compare, keep, runs as R, section, stats, table
from conftest import ROOT
from qerl_exp.config import as_dict
from qerl_exp.config.compose import compose


def _run(tmp: Path, name: str, config: str, base: int, seed: int, rewards, shares=None, strategy="full_precision",
         overrides=(), step0=None) -> Path:
    cfg = as_dict(compose([f"strategy={strategy}", f"train.steps={len(rewards)}", "monitor.every=1",
                           f"model.warmup.seed={base}", f"seed={seed}", *overrides])[0])
    cfg["choices"] = {"config": config, "strategy": strategy}
    rows = []
    step_s = 1.0 + zlib.crc32(f"{tmp}/{name}".encode()) / 2**32  # distinct runs have distinct wall times
    for step, reward in enumerate(rewards):
        row = {"step": step, "reward": reward, "entropy": 0.1, "sampler/entropy": 0.2, "noise/sigma": 0.0,
               "perf/rollout_tok_s": 1.0, "perf/step_s": step_s, "mem/weights_bytes": 1.0, "mem/peak_bytes": 1.0,
               "entropy_gain": 0.01 * base + 0.001 * seed}
        if shares is not None:
            row["fork/b_share"] = shares[step]
        rows.append(row)
    rows[0].update(step0 or {})
    path = tmp / name
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text("{}")
    return path


def test_holm_and_tost_against_their_definitions():
    assert stats.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert stats.holm([0.5, math.nan, 0.001]) == pytest.approx([0.5, math.nan, 0.002], nan_ok=True)
    x = [0.3, -0.2, 0.1, 0.05, -0.1, 0.2]
    want = max(sp.ttest_1samp(x, -0.5, alternative="greater").pvalue, sp.ttest_1samp(x, 0.5, alternative="less").pvalue)
    assert stats.tost(x, 0.5) == pytest.approx(want)
    assert stats.t_test(x) == pytest.approx(sp.ttest_1samp(x, 0.0).pvalue)
    assert stats.one_sided(x) == pytest.approx(sp.ttest_1samp(x, 0.0, alternative="greater").pvalue)
    a, b = [1.0, 1.3, 0.9, 1.6], [0.2, 0.5, 0.1]
    iv, p = stats.welch(a, b)
    ref = sp.ttest_ind(a, b, equal_var=False)
    assert p == pytest.approx(ref.pvalue) and (iv.low, iv.high) == pytest.approx(tuple(ref.confidence_interval()))


def test_a_contrast_pairs_by_base_and_seed_and_replicates_over_bases():
    rng = np.random.default_rng(0)
    units = [(b, s) for b in (10, 11, 12) for s in range(4)]
    ref = {u: float(rng.normal()) for u in units}
    row = {u: ref[u] + 0.3 * (u[0] - 10) + float(rng.normal(0, 0.1)) for u in units}
    c = compare.contrast("x", "final_reward", row, ref)
    base_means = [np.mean([row[u] - ref[u] for u in units if u[0] == b]) for b in (10, 11, 12)]
    want = sp.ttest_1samp(base_means, 0.0)
    assert c.kind == "bases" and (c.pairs, c.bases) == (12, 3)
    assert c.difference.mean == pytest.approx(np.mean(base_means)) and c.p == pytest.approx(want.pvalue)
    assert (c.difference.low, c.difference.high) == pytest.approx(tuple(want.confidence_interval()))
    pairs = sp.ttest_1samp([row[u] - ref[u] for u in units], 0.0)
    assert (c.over_pairs.low, c.over_pairs.high) == pytest.approx(tuple(pairs.confidence_interval()))
    one_base = compare.contrast("x", "final_reward", {u: v for u, v in row.items() if u[0] == 11},
                                {u: v for u, v in ref.items() if u[0] == 11})
    assert one_base.kind == "pairs" and one_base.over_pairs is None and one_base.pairs == 4
    apart = compare.contrast("x", "final_reward", {(0, 1): 1.0, (0, 2): 2.0, (0, 3): 1.5}, {(0, 7): 0.0, (0, 8): 0.4})
    assert apart.kind == "welch" and apart.p == pytest.approx(sp.ttest_ind([1.0, 2.0, 1.5], [0.0, 0.4], equal_var=False).pvalue)


def test_discovery_time_is_censored_at_the_run_length(tmp_path):
    found = R.read_run_dir(_run(tmp_path, "a", "fp", 1, 0, [0.0] * 6, shares=[0.0, 0.1, 0.3, 0.5, 0.9, 1.0]))
    never = R.read_run_dir(_run(tmp_path, "b", "fp", 1, 1, [0.0] * 6, shares=[0.0, 0.0, 0.2, 0.0, 0.4, 0.1]))
    assert compare.discovery(found) == (3, True) and compare.discovery(never) == (6, False)
    assert compare.first_step(never, "fork/b_share", 0.0, strict=True) == (2, True)
    assert compare.median_time([(3, True), (6, False), (6, False)]) == "> 6"
    assert compare.median_time([(3, True), (5, True), (6, False)]) == "5"


def test_the_section_compares_rows_with_the_reference_and_tables_discovery(tmp_path):
    """Two arms x 2 bases x 3 seeds of task=fork records: the arm discovers 4 steps sooner on base 1
    and 2 sooner on base 2; the section's contrast is the mean of those base means, tested over bases."""
    for base, lead in ((1, 4), (2, 2)):
        for seed in range(3):
            at = 10 + seed + base
            shares = [0.6 if s >= at else 0.0 for s in range(20)]
            early = [0.6 if s >= at - lead else 0.0 for s in range(20)]
            _run(tmp_path / "runs", f"fp_b{base}_s{seed}", "full_precision", base, seed, [1.0] * 20, shares)
            _run(tmp_path / "runs", f"q_b{base}_s{seed}", "quick", base, seed, [1.0] * 20, early,
                 strategy="nvfp4_lora_noaqn")
    loaded = R.load([str(tmp_path / "runs")])
    built = section.build(loaded, margins={"discovery": 10.0})
    assert [r.label for r in built.rows] == ["full_precision", "quick"] and [r.seeds for r in built.rows] == [6, 6]
    text = section.to_markdown(built, "python -m analysis runs")
    row = next(line for line in text.splitlines() if line.startswith("| discovery time, B on half (steps) | quick |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "6 pairs, 2 bases" and cells[3].startswith("-3.0 [")
    want = sp.ttest_1samp([-4.0, -2.0], 0.0)
    assert cells[5] == f"{want.pvalue:.3f}" and cells[3] == (
        f"-3.0 [{want.confidence_interval()[0]:.1f}, {want.confidence_interval()[1]:.1f}]")
    assert "| quick | 6 | n/a | 6 of 6 |" in text and "equivalence margins (TOST): discovery time, B on half (steps) +-10" in text
    # two bases: "similar" within 10 steps, on a test whose minimum detectable effect is wider than that
    assert cells[7] == f"{stats.mde([-4.0, -2.0]):.1f}" and cells[8] == f"similar (+-10; MDE {cells[7]})"


def test_the_best_aqn_setting_is_chosen_among_rows_that_differ_in_noise_alone(tmp_path):
    for seed in range(2):
        _run(tmp_path, f"fp_s{seed}", "full_precision", 0, seed, [1.0] * 4)
        _run(tmp_path, f"paper_s{seed}", "paper", 0, seed, [1.0] * 4, strategy="nvfp4_lora")
        _run(tmp_path, f"noaqn_s{seed}", "noaqn", 0, seed, [1.2] * 4, strategy="nvfp4_lora_noaqn")
        _run(tmp_path, f"fast_s{seed}", "noaqn_lr", 0, seed, [2.0] * 4, strategy="nvfp4_lora_noaqn",
             overrides=("train.lr=1e-2",))
    built = section.build(R.load([str(tmp_path)]))
    assert sorted(r.label for r in built.candidates) == ["noaqn", "paper"] and built.best.label == "noaqn"
    lr_only = section.build(R.load([str(tmp_path / "fp_s0"), str(tmp_path / "fp_s1"), str(tmp_path / "noaqn_s0"),
                                    str(tmp_path / "noaqn_s1"), str(tmp_path / "fast_s0"), str(tmp_path / "fast_s1")]))
    assert lr_only.best is None and "differ in `noise.*` alone" in section.to_markdown(lr_only, "c")


def test_the_table_keeps_the_first_paths_run_of_a_seed(tmp_path):
    study = _run(tmp_path / "study", "z_fp_s0", "full_precision", 0, 0, [1.0] * 4)
    repeat = _run(tmp_path / "repeat", "a_fp_s0", "full_precision", 0, 0, [0.0] * 4)
    for order, kept in (([study, repeat], study), ([repeat, study], repeat)):
        groups, notes = table.select(R.load([str(p) for p in order]).runs)
        assert [r.source for r in groups["full_precision"]] == [str(kept)]
        assert "only the first is used" in notes[0]


def test_keep_names_a_record_by_its_base_and_seed():
    config = {"choices": {"config": "nvfp4_lora"}, "seed": 3, "model": {"warmup": {"seed": 12}}}
    assert keep.record_name(config, Path("trial0001_s3")) == "nvfp4_lora_b12_s3"
    assert keep.record_name({**config, "model": {"warmup": {"seed": 0}}}, Path("t")) == "nvfp4_lora_s3"


def test_a_grid_runs_every_config_of_a_seed_before_the_next_seed():
    from qerl_exp.sweep.spec import grid_points, load_plan

    plan = load_plan(ROOT / "sweeps" / "fork_pilot.yaml", [])
    points = grid_points(plan.params)
    assert len(points) == 36
    assert [p["config"] for p in points[:3]] == list(plan.configs) and len({p["seed"] for p in points[:3]}) == 1


def test_keep_takes_a_folder_of_runs_by_their_paths(tmp_path):
    _run(tmp_path / "out" / "full_precision", "s0", "full_precision", 0, 0, [1.0] * 3)
    _run(tmp_path / "out" / "ablation" / "q_lr", "s1", "q_lr", 0, 1, [1.0] * 3)
    unfinished = _run(tmp_path / "out" / "nf4_dq", "s0", "nf4_dq", 0, 0, [1.0] * 3)
    (unfinished / "summary.json").unlink()
    (tmp_path / "out" / "full_precision" / "s0" / "checkpoints").mkdir()
    written, left_out = keep.keep(tmp_path / "out", tmp_path / "kept")
    assert sorted(p.relative_to(tmp_path / "kept").as_posix() for p in written) == ["ablation/q_lr/s1", "full_precision/s0"]
    assert sorted(f.name for f in (tmp_path / "kept" / "full_precision" / "s0").iterdir()) == [
        "config.json", "metrics.jsonl", "summary.json"]
    assert len(left_out) == 1 and "nf4_dq" in left_out[0]


def test_a_record_kept_packed_reads_as_the_plain_one(tmp_path):
    _run(tmp_path / "out" / "full_precision", "s0", "full_precision", 0, 0, [1.0, 0.5, 0.25], shares=[0.0, 0.6, 1.0])
    keep.keep(tmp_path / "out", tmp_path / "plain")
    keep.keep(tmp_path / "out", tmp_path / "packed", packed=True)
    plain, packed = (R.read_run_dir(tmp_path / k / "full_precision" / "s0") for k in ("plain", "packed"))
    assert not (tmp_path / "packed" / "full_precision" / "s0" / "metrics.jsonl").exists()
    assert packed.history == plain.history and not R.problems(packed)
    again = keep.keep(tmp_path / "out", tmp_path / "again", packed=True)[0][0] / "metrics.jsonl.gz"
    assert again.read_bytes() == (tmp_path / "packed" / "full_precision" / "s0" / "metrics.jsonl.gz").read_bytes()


def _entropy(p: float) -> float:
    """A two-way choice's entropy in nats."""
    return -p * math.log(p) - (1 - p) * math.log(1 - p)


def test_the_minimum_detectable_effect_is_found_with_the_stated_power():
    """At the MDE a two-sided t-test at alpha 0.05 rejects in 80 % of simulated samples; a smaller
    effect less often, a larger one more."""
    rng = np.random.default_rng(1)
    n, sd = 6, 2.0
    effect = stats.mde(list(rng.normal(0, sd, n)))
    spread = stats.stdev(list(rng.normal(0, sd, n)))  # mde reads the spread of its values
    effect = stats.mde_of(sd / math.sqrt(n), n - 1)
    samples = rng.normal(effect, sd, (40000, n))
    t = samples.mean(1) / (samples.std(1, ddof=1) / math.sqrt(n))
    crit = sp.t.ppf(0.975, n - 1)
    assert np.mean(np.abs(t) > crit) == pytest.approx(0.8, abs=0.01)
    assert stats.mde_of(1.0, 10_000) == pytest.approx(sp.norm.ppf(0.975) + sp.norm.ppf(0.8), rel=1e-3)
    assert math.isnan(stats.mde([1.0])) and math.isnan(stats.mde_of(0.0, 4)) and spread > 0


def test_route_b_is_found_once_a_step_holds_more_b_than_the_prior_gives():
    for prior, n in ((0.01, 32), (0.01, 64), (0.003, 16)):
        k = compare.found_count(prior, n)
        assert sp.binom.sf(k - 1, n, prior) < 1e-3 <= sp.binom.sf(k - 2, n, prior)
    assert (compare.found_count(0.01, 32), compare.found_count(0.01, 64)) == (4, 5)


def test_pi_b_is_read_from_the_route_tokens_entropy():
    for p in (1e-4, 0.01, 0.2, 0.5):
        assert compare.route_b_probability(_entropy(p)) == pytest.approx(p, rel=1e-9)
    assert math.isnan(compare.route_b_probability(0.0)) and math.isnan(compare.route_b_probability(0.8))


@functools.cache
def _fork_config(strategy: str) -> str:
    """A task=fork run's config of 4 prompts x 8 completions a step at prior 0.01, as JSON (composed once)."""
    cfg = as_dict(compose([f"strategy={strategy}", "task=fork", "task.route_b_prior=0.01", "train.prompts_per_step=4",
                           "algo.group_size=8", "train.steps=40", "monitor.every=1"])[0])
    cfg["choices"] = {"strategy": strategy}
    return json.dumps(cfg)


def _fork_row(tmp, label, strategy, pi, times, kl=0.0, entropy=0.2, steps=40, temperature=1.0):
    """One row of task=fork runs: pi(B) at step 0 per (base, seed), the step at which 4 of 32
    completions first take B (`times`), quant/kl and the sampler's entropy at step 0."""
    for (base, seed), p in pi.items():
        config = json.loads(_fork_config(strategy))
        config.update(seed=seed, choices={**config["choices"], "config": label})
        config["model"]["warmup"]["seed"], config["algo"]["temperature"] = base, temperature
        at = times[(base, seed)]
        rows = [{"step": s, "reward": 1.0, "entropy": 0.1, "sampler/entropy": 0.2, "noise/sigma": 0.0,
                 "perf/rollout_tok_s": 1.0, "perf/step_s": 1.0 + zlib.crc32(f"{label}{base}{seed}".encode()) / 2**32,
                 "mem/weights_bytes": 1.0, "mem/peak_bytes": 1.0, "entropy_gain": 0.0,
                 "fork/b_share": 0.03 if s < at else 0.125} for s in range(steps)]
        rows[0].update({"fork/route_entropy": _entropy(p), "quant/kl": kl, "sampler/entropy": entropy + seed * 0.01})
        run = tmp / f"{label}_b{base}_s{seed}"
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps(config))
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "summary.json").write_text("{}")


def test_every_row_is_reported_beside_its_dose_at_step_0(tmp_path):
    """pi(B) moved by a known factor per base, and quant/kl and the sampler's entropy known: the dose
    table and the contrasts' dose column say so, computed across bases as the contrasts are."""
    units = [(b, s) for b in (1, 2) for s in range(3)]
    ref = {u: 0.01 * (1 + 0.1 * u[1]) for u in units}
    factor = {1: 1.2, 2: 1.4}
    _fork_row(tmp_path, "full_precision", "full_precision", ref, {u: 20 for u in units})
    _fork_row(tmp_path, "q", "nvfp4_lora_noaqn", {u: ref[u] * factor[u[0]] for u in units}, {u: 18 for u in units},
              kl=0.002, entropy=0.25)
    rows = {r.label: r.runs for r in section.build(R.load([str(tmp_path)])).rows}
    dose = compare.doses(rows)["q"]
    assert tuple(compare.dose_values(rows["q"][0])) == compare.DOSES
    want_log = np.mean([math.log(factor[b]) for b in (1, 2)])  # each base's mean log ratio, then their mean
    assert dose.log_pi_b.difference.mean == pytest.approx(want_log, rel=1e-6)
    assert dose.pi_b_shift().mean == pytest.approx(math.expm1(want_log), rel=1e-6)
    assert dose.kl.mean == pytest.approx(0.002) and dose.on_policy.difference.mean == pytest.approx(0.05)
    assert dose.text() == f"KL 0.0020; H +0.0500; pi(B) {100 * math.expm1(want_log):+.1f} %"
    lines = compare.contrasts_markdown(rows, ["found"])
    line = next(x for x in lines if x.startswith("| B found above the prior (step) | q |"))
    assert line.endswith(f"| {dose.text()} |") and "| -2.0 [" in line
    table_ = compare.doses_markdown(rows)
    assert any(x.startswith("| q | 0.0020 [0.0020, 0.0020] | 0.0500 [") and "+29.6 %" in x for x in table_)


def test_discovery_follows_the_dose_with_the_slope_it_was_made_with(tmp_path):
    """Rows whose step of finding B is c / pi(B), rounded: each base's slope is the least-squares slope
    of the log ratios recomputed here (numpy), about -1."""
    units = [(b, s) for b in (1, 2) for s in range(3)]
    base_pi = {u: 0.01 * (1 + 0.05 * u[1] + 0.02 * u[0]) for u in units}
    rows_pi = {"full_precision": base_pi, **{f"t{k}": {u: base_pi[u] * k for u in units} for k in (1.25, 1.6, 2.5)}}
    times = {label: {u: round(0.3 / p[u]) for u in units} for label, p in rows_pi.items()}
    for label, pi in rows_pi.items():
        _fork_row(tmp_path, label, "full_precision", pi, times[label],
                  temperature=1.0 if label == "full_precision" else 1 + float(label[1:]) / 10)
    rows = {r.label: r.runs for r in section.build(R.load([str(tmp_path)])).rows}
    d = compare.dose_response(rows, "found")
    assert sorted(d.slopes) == [1, 2]
    for base in (1, 2):
        seeds = [u for u in units if u[0] == base]
        m = {k: (np.mean([rows_pi[k][u] for u in seeds]), np.mean([times[k][u] for u in seeds])) for k in rows_pi}
        x = [math.log(m[k][0] / m["full_precision"][0]) for k in rows_pi if k != "full_precision"]
        y = [math.log(m[k][1] / m["full_precision"][1]) for k in rows_pi if k != "full_precision"]
        assert d.slopes[base] == pytest.approx(np.polyfit(x, y, 1)[0], rel=1e-9) and d.slopes[base] == pytest.approx(-1, abs=0.1)
    assert d.slope.mean == pytest.approx(np.mean(list(d.slopes.values())))
    text = "\n".join(compare.dose_response_markdown(rows))
    assert f"| B found above the prior (step) | ln pi(B) ratio | 2 | 3 | {d.slope.text(2)} |" in text
    kl = compare.dose_response(rows, "found", dose="kl")  # every row's KL is 0: no slope to draw
    assert kl is None and "| KL to full precision (nats) |" not in text


def test_the_command_prints_each_rows_dose_beside_its_discovery_contrasts(tmp_path, capsys):
    """`python -m analysis` prints, for task=fork, every row's pi(B) shift and KL at step 0 and its
    discovery contrasts with their minimum detectable effects."""
    from analysis import __main__ as cli

    units = [(b, s) for b in (1, 2) for s in range(3)]
    ref = {u: 0.01 for u in units}
    _fork_row(tmp_path / "runs", "full_precision", "full_precision", ref, {u: 20 + u[1] for u in units})
    _fork_row(tmp_path / "runs", "q", "nvfp4_lora_noaqn", {u: 0.012 for u in units},
              {u: 18 - u[0] + u[1] for u in units}, kl=0.003)  # 3 steps sooner on base 1, 4 on base 2
    assert cli.main([str(tmp_path / "runs"), "--out", str(tmp_path / "report"), "--no-figures"]) == 0
    out = capsys.readouterr().out
    dose = next(x for x in out.splitlines() if x.startswith("| q | 0.0030 [0.0030, 0.0030] |"))
    assert "+20.0 %" in dose
    found = next(x for x in out.splitlines() if x.startswith("| B found above the prior (step) | q |"))
    cells = [c.strip() for c in found.strip("|").split("|")]
    assert cells[3].startswith("-3.5 [") and cells[7] == f"{stats.mde([-3.0, -4.0]):.1f}"
    assert cells[9] == "KL 0.0030; H +0.0000; pi(B) +20.0 %"
