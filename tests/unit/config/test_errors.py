"""Bad input and broken files end in one line naming the file, field or setting and what to change;
run directories refuse what would mix two configs; analysis says why it skips a run."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

from conftest import ROOT
from qerl_exp.cli import validate
from qerl_exp.config import Config, as_dict
from qerl_exp.run.console import UsageError


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


def test_config_differences_outside_the_allow_list_are_refused(tmp_path):
    from qerl_exp.run import rundir

    run_dir = tmp_path / "run"
    config = {**as_dict(Config()), "choices": {"quant": "bf16"}}
    with rundir.claim(run_dir, config):
        (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')  # it has begun: a step logged
    saved = (run_dir / "config.json").read_bytes()
    other = as_dict(Config(seed=3))
    other["lora"]["r"] = 32
    with pytest.raises(rundir.ConfigChangedError) as e:
        rundir.claim(run_dir, {**other, "choices": {"quant": "nvfp4"}})
    assert "lora.r: 16 -> 32; seed: 0 -> 3" in _one_line(e)
    assert (run_dir / "config.json").read_bytes() == saved
    for steps in (99, 2):  # longer or shorter: train.steps sets the learning-rate and noise schedules of every step
        other = as_dict(Config())
        other["train"]["steps"] = steps
        with pytest.raises(rundir.ConfigChangedError) as e:
            rundir.claim(run_dir, {**other, "choices": {}})
        assert f"(train.steps: 60 -> {steps}); a run keeps its length" in _one_line(e)
    assert (run_dir / "config.json").read_bytes() == saved
    offline = as_dict(Config())
    offline["tracker"]["mode"] = "disabled"
    with rundir.claim(run_dir, {**offline, "choices": {}}):  # where a run logs may change
        pass
    written = json.loads((run_dir / "config.json").read_text())
    assert written["tracker"]["mode"] == "disabled" and written["choices"] == {"quant": "bf16"}  # the recorded choices stay
    (run_dir / "summary.json").write_text("{}")
    with pytest.raises(rundir.RunExistsError) as e:
        rundir.claim(run_dir, {**other, "choices": {}})
    assert "holds a finished run of 60 steps, and a run keeps its length" in _one_line(e)


def test_a_claim_is_held_until_released_and_refused_to_any_other_claim(tmp_path):
    import os
    import subprocess

    from qerl_exp.run import rundir

    run_dir = tmp_path / "run"
    config = as_dict(Config())
    probe = ("import sys; from qerl_exp.run import rundir\n"
             "try:\n    rundir.claim(sys.argv[1], rundir.saved_config(sys.argv[1]))\nexcept rundir.RunDirBusy as e:\n    print(e)")
    owned = rundir.claim(run_dir, config)
    with pytest.raises(rundir.RunDirBusy, match=f"in use by process {os.getpid()}"):  # one claim per run, also here
        rundir.claim(run_dir, config)
    held = subprocess.run([sys.executable, "-c", probe, str(run_dir)], cwd=ROOT, capture_output=True, text=True)
    owned.release()
    free = subprocess.run([sys.executable, "-c", probe, str(run_dir)], cwd=ROOT, capture_output=True, text=True)
    assert f"{run_dir.absolute()} is in use by process {os.getpid()}" in held.stdout, held.stderr
    assert free.stdout == "", free.stdout


def test_a_task_file_changed_under_a_run_is_refused(tmp_path):
    import shutil

    from qerl_exp.run import record, rundir
    from qerl_exp.config.compose import compose
    from qerl_exp.eval.__main__ import run_config as eval_config
    from qerl_exp.train import run_config

    data = tmp_path / "gsm8k.jsonl"
    shutil.copy(ROOT / "tests" / "data" / "gsm8k_sample.jsonl", data)
    cfg = compose(["task=gsm8k", f"task.path={data}"])[0]
    run_dir = tmp_path / "run"
    recorded = run_config(cfg, {})
    with rundir.claim(run_dir, {k: v for k, v in recorded.items() if k != record.DATA_KEY}):  # as runs were made before
        (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')  # it has begun: a step logged
    with rundir.claim(run_dir, recorded):  # continued: nothing to compare with yet, and from now on recorded
        pass
    assert json.loads((run_dir / "config.json").read_text())[record.DATA_KEY] == recorded[record.DATA_KEY]
    data.write_text(data.read_text().replace("#### ", "####  ", 1))  # one answer edited
    with pytest.raises(rundir.ConfigChangedError) as e:
        rundir.claim(run_dir, run_config(cfg, {}))
    assert "(task_sha256.path: " in _one_line(e) and "the task's data file changed since the run started" in _one_line(e)
    with pytest.raises(ValueError, match=f"task.path={data} changed since the run was trained"):
        eval_config(run_dir)


@pytest.mark.parametrize("args, message", [
    (["seed=-1"], "seed must be an integer in 0..4294967295, got -1"),
    (["run_dir=README.md"], "run_dir=README.md is a file, not a directory"),
    (["run_dir=README.md/run"], f"cannot write {ROOT / 'README.md'}: a file stands where a directory is needed; "
                                "remove that file or choose another run_dir"),
    (["model.cache_dir=README.md/cache"], f"cannot write {ROOT / 'README.md'}: a file stands where a directory is needed; "
                                          "remove that file or choose another model.cache_dir"),
])
def test_bad_run_settings_are_one_line(args, message):
    with pytest.raises(UsageError) as e:
        validate(args, multirun=False)
    assert message in _one_line(e)


def test_resume_with_another_run_dir_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(as_dict(Config())))
    with pytest.raises(UsageError) as e:
        validate([f"resume={tmp_path}", "run_dir=elsewhere"], multirun=False)
    assert _one_line(e) == f"resume={tmp_path} continues that run in its own directory, but run_dir=elsewhere names another; drop run_dir="


def test_garbage_config_json_is_named(tmp_path):
    (tmp_path / "config.json").write_bytes(bytes(range(256)))
    with pytest.raises(UsageError) as e:
        validate([f"resume={tmp_path}"], multirun=False)
    assert f"{tmp_path / 'config.json'} is not readable JSON" in _one_line(e)


def test_binary_task_file_is_named(tmp_path):
    from qerl_exp.tasks.datasets import gsm8k_problem, load_problems

    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"question": "1+1?", "answer": "#### 2"}\n' + bytes(range(128, 256)) + b"\n")
    with pytest.raises(ValueError) as e:
        load_problems(path, gsm8k_problem)
    assert f"{path}: 1 malformed line: line 2: not UTF-8 text (byte 0x80 at column 1)" in _one_line(e)


def test_storage_url_and_missing_driver_are_one_line(monkeypatch):
    from qerl_exp.sweep.spec import load_plan
    from qerl_exp.sweep.storage import storage_url

    spec = ROOT / "sweeps" / "noise_schedule.yaml"
    with pytest.raises(UsageError) as e:
        storage_url(load_plan(spec, ["n_trials=1", "storage=postgresql://::::/"], check_config=False))
    assert "storage='postgresql://::::/' is not a URL" in _one_line(e)
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if not installed: import raises ImportError
    monkeypatch.setitem(sys.modules, "psycopg2", None)
    with pytest.raises(UsageError) as e:
        storage_url(load_plan(spec, ["n_trials=1", "storage=postgresql://me@db:5432/optuna"], check_config=False))
    assert "pip install 'qerl-exp[postgres]'" in _one_line(e)


def test_unreachable_wandb_host_falls_back_to_offline_at_once(tmp_path, monkeypatch):
    from qerl_exp.config import TrackerConfig
    from qerl_exp.run.tracking import Tracker

    monkeypatch.setenv("WANDB_BASE_URL", "https://qerl-exp-test.invalid")  # .invalid never resolves (RFC 2606)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = Tracker(tmp_path, TrackerConfig(mode="online"), {"seed": 0}, name="t", group="g", job_type="train", tags=[])
    tracker.finish({"reward/final": 0.0})
    messages = [str(w.message) for w in caught if "W&B" in str(w.message)]
    assert len(messages) == 1 and "cannot resolve qerl-exp-test.invalid" in messages[0], messages
    made = sorted(p.name for p in (tmp_path / "wandb").iterdir() if not p.is_symlink())
    assert len(made) == 1 and made[0].startswith("offline-run-"), made


def test_wandb_that_cannot_write_its_folder_leaves_metrics_jsonl(tmp_path):
    from qerl_exp.config import TrackerConfig
    from qerl_exp.run.tracking import Tracker

    (tmp_path / "wandb").write_text("")  # a file where W&B keeps its runs
    with pytest.warns(UserWarning, match=f"W&B cannot start its offline run in {tmp_path / 'wandb'} .*; logging to metrics.jsonl only"):
        tracker = Tracker(tmp_path, TrackerConfig(mode="offline"), {"seed": 0}, name="t", group="g", job_type="train", tags=[])
    tracker.log(0, {"reward": 1.0})
    tracker.finish({"reward/final": 1.0})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 0, "reward": 1.0}
    assert (tmp_path / "summary.json").exists()


# --------------------------------------------------------------------------- analysis


def _run(path: Path, steps: int, rows: list[str], summary: bool = True, error: str = "") -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**as_dict(Config()), "choices": {}} | {"train": {"steps": steps}}))
    (path / "metrics.jsonl").write_text("".join(r + "\n" for r in rows))
    if summary:
        (path / "summary.json").write_text("{}")
    if error:
        (path / "error.txt").write_text(f"Traceback (most recent call last):\n  ...\n{error}\n")
    return path


def test_analysis_names_failed_runs_and_corrupt_lines(tmp_path):
    from analysis.runs import load

    failed = _run(tmp_path / "runs" / "failed", 3, ['{"step": 0}'], summary=False,
                  error="qerl_exp.train.NonFiniteError: 2 consecutive steps with non-finite logits")
    corrupt = _run(tmp_path / "runs" / "corrupt", 2, ['{"step": 0, "rew', '{"step": 1}'])
    skipped = dict(load([str(tmp_path / "runs")], presets={}).skipped)
    assert skipped[str(failed)] == "failed: qerl_exp.train.NonFiniteError: 2 consecutive steps with non-finite logits"
    assert "metrics.jsonl line(s) [1] are not JSON objects with a step" in skipped[str(corrupt)]
    assert "more than once" not in skipped[str(corrupt)]


@pytest.mark.parametrize("paths, expected", [
    (["runs/strategies"], "runs/strategies/report"),
    (["runs/strategies/nvfp4_lora/s0", "runs/strategies/nf4_dq/s1"], "runs/strategies/report"),
    (["runs/strategies/nvfp4_lora/s0"], "runs/strategies/nvfp4_lora/report"),
    (["runs/**/run-*.wandb"], "runs/report"),
    ([], "runs/report"),
])
def test_analysis_writes_beside_the_runs_by_default(tmp_path, monkeypatch, paths, expected):
    from analysis.__main__ import default_out

    monkeypatch.chdir(tmp_path)
    for p in ("runs/strategies/nvfp4_lora/s0", "runs/strategies/nf4_dq/s1"):
        (tmp_path / p).mkdir(parents=True)
        (tmp_path / p / "config.json").write_text("{}")
    out = default_out(paths)
    assert out == (tmp_path / expected if paths else Path(expected))


@pytest.mark.parametrize("args, message", [
    (["--out", "FILE"], "error: --out FILE is a file, not a directory; give a directory (created if needed)"),
    (["--out", "FILE/report"], "error: cannot write FILE: a file stands where a directory is needed; remove that file or "
                               "choose another --out DIR"),
    (["--optuna-storage", "study.db"], "error: --optuna-storage 'study.db' is not a URL; use sqlite:///PATH"),
    (["--optuna-storage", "sqlite:///TMP/none.db"], "error: --optuna-storage sqlite:///TMP/none.db: TMP/none.db does not exist"),
    (["--optuna-storage", "sqlite:///TMP/empty.db", "--optuna-study", "aqn"],
     "error: no study 'aqn' in sqlite:///TMP/empty.db (studies there: none); give --optuna-study NAME"),
])
def test_analysis_refuses_what_it_cannot_write_or_read_before_reading_runs(tmp_path, capsys, args, message):
    import sqlite3

    from analysis.__main__ import main

    (tmp_path / "FILE").write_text("")
    sqlite3.connect(tmp_path / "empty.db").close()  # a storage without tables or studies
    args = [a.replace("FILE", str(tmp_path / "FILE")).replace("TMP", str(tmp_path)) for a in args]
    assert main([str(tmp_path / "runs"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message.replace("FILE", str(tmp_path / "FILE")).replace("TMP", str(tmp_path))), err
    assert not (tmp_path / "none.db").exists() and not (tmp_path / "runs").exists()
