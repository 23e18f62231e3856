"""Grid studies (`sampler: grid`, the spec's `configs`) and sweep workers pinned to GPUs.

The subprocess test runs a real 2 x 1 grid (two strategy presets, one seed) with two workers and
the tiny model, then reruns the command; the rest are pure functions and spec errors (no runs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from conftest import ROOT
from qerl_exp.run.console import UsageError
from qerl_exp.sweep.__main__ import visible_gpus, worker_env
from qerl_exp.sweep.spec import load_plan, make_sampler, suggest, trial_overrides
from qerl_exp.sweep.study import _enqueue_grid_point

TINY = ["quant=bf16", "tracker=disabled", "train.steps=2", "train.prompts_per_step=2", "algo.group_size=2",
        "monitor.every=0"]


def grid_spec(tmp_path: Path, **fields) -> Path:
    spec = {"configs": {"full_precision": ["strategy=full_precision"], "bf16_aqn": ["strategy=bf16_aqn"]},
            "params": {"seed": {"type": "categorical", "choices": [0]}}, "objective": {"metric": "reward"},
            "sampler": "grid", **fields}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def sweep(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qerl_exp.sweep", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_worker_pinning_round_robin():
    gpus = ["0", "1", "2"]
    assert [worker_env({}, i, gpus)["CUDA_VISIBLE_DEVICES"] for i in range(5)] == ["0", "1", "2", "0", "1"]
    # One GPU or none: the environment's own setting (or its absence) stands.
    assert "CUDA_VISIBLE_DEVICES" not in worker_env({"HOME": "/root"}, 3, [])
    assert worker_env({"CUDA_VISIBLE_DEVICES": "5"}, 3, ["5"])["CUDA_VISIBLE_DEVICES"] == "5"
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "4, GPU-ab12,"}) == ["4", "GPU-ab12"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({}) == []  # this machine has no CUDA device


def test_grid_spec(tmp_path):
    plan = load_plan(grid_spec(tmp_path), [], check_config=False)
    assert plan.n_trials == 2 and plan.pruner == {"name": "none"}
    assert isinstance(make_sampler(plan), optuna.samplers.GridSampler)
    assert trial_overrides(plan, {"config": "bf16_aqn", "seed": 0}) == ["strategy=bf16_aqn", "seed=0"]
    for fields, argv, message in [
        ({}, ["n_trials=3"], "n_trials=3 exceeds the grid's 2 points"),
        ({"params": {"noise.sigma": {"type": "float", "low": 0.1, "high": 0.2}}}, [], "a grid takes categorical or int"),
        ({"seeds": [0, 1]}, [], "not both"),
        ({"configs": {"a": ["strategy=bf16_aqn"]}, "params": {}}, [], "the grid has one point"),
        ({"configs": {"a": "strategy=bf16_aqn"}}, [], "configs.a must be a list of Hydra overrides"),
    ]:
        with pytest.raises(UsageError, match=message):
            load_plan(grid_spec(tmp_path, **fields), argv, check_config=False)


def test_bad_config_is_named(tmp_path):
    spec = grid_spec(tmp_path, configs={"ok": ["strategy=bf16_aqn"], "typo": ["strategy=bf16_aqm"]})
    with pytest.raises(UsageError, match=r"grid.yaml: configs.typo: strategy=bf16_aqm is not a preset; choose one of"):
        load_plan(spec, [])


def test_failed_grid_point_comes_back(tmp_path):
    plan = load_plan(grid_spec(tmp_path, params={"seed": {"type": "categorical", "choices": [0, 1]}}), [],
                     check_config=False)
    study = optuna.create_study(sampler=make_sampler(plan))
    # every config of a seed before the next seed: a study cut short holds whole sets of rows to pair
    points = [{"config": c, "seed": s} for s in (0, 1) for c in ("full_precision", "bf16_aqn")]

    def take() -> optuna.Trial:
        _enqueue_grid_point(plan, study)
        return study.ask()

    def point(trial: optuna.Trial) -> dict:
        return study.get_trials(deepcopy=False)[trial.number].system_attrs["fixed_params"]

    first, second = take(), take()  # both RUNNING, their params not suggested yet
    assert [point(first), point(second)] == points[:2]
    study.tell(first, state=TrialState.FAIL)
    rest = [take(), take()]  # the untried points first, so that a failing point holds up nothing
    assert [point(t) for t in rest] == points[2:]
    for t in (second, *rest):
        assert suggest(plan, t) == point(t)  # as a worker's run_trial draws it
        study.tell(t, 1.0)
    again = take()  # then the failed point comes back
    assert point(again) == points[0]
    study.tell(again, state=TrialState.FAIL)
    assert point(take()) == points[0]


@pytest.mark.slow
def test_grid_study_fills_once_and_resumes(tmp_path):
    spec, out = grid_spec(tmp_path), tmp_path / "sweep"
    args = (str(spec), "n_jobs=2", f"sweep_dir={out}", *TINY)
    first = sweep(*args, env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert first.returncode == 0, first.stderr[-3000:]
    # Each worker was started pinned to one of the two "GPUs" (no CUDA here: the runs use the CPU).
    logs = {p.name.rsplit("-", 1)[1]: p.read_text() for p in (out / "logs").glob("*.log")}
    assert "CUDA_VISIBLE_DEVICES=0" in logs["w0.log"] and "CUDA_VISIBLE_DEVICES=1" in logs["w1.log"]
    storage = optuna.storages.RDBStorage(f"sqlite:///{out / 'study.db'}")
    trials = optuna.load_study(study_name="grid", storage=storage).get_trials()
    assert sorted((t.state, t.params["config"], t.params["seed"]) for t in trials) == [
        (TrialState.COMPLETE, "bf16_aqn", 0), (TrialState.COMPLETE, "full_precision", 0)]
    for t in trials:
        run = Path(t.user_attrs["run_dirs"][0])
        assert (run / "summary.json").is_file() and f'"strategy": "{t.params["config"]}"' in (run / "config.json").read_text()

    again = sweep(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(optuna.load_study(study_name="grid", storage=storage).get_trials()) == 2
    assert len(list((out / "logs").glob("*.log"))) == 2  # no worker started

    report = subprocess.run([sys.executable, "-m", "analysis", str(out / "trials"), "--out", str(tmp_path / "report")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr[-3000:]
    table = (tmp_path / "report" / "strategy_table.md").read_text()
    assert "| full_precision | 1 |" in table and "| bf16_aqn | 1 |" in table
