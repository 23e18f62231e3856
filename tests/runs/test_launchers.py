"""Hydra launcher plugins (the `cluster` extra) on `python -m qerl_exp -m`: joblib runs a multirun's
jobs in parallel processes, submitit_local runs a job through submitit, and a launcher that is not
installed is refused in one line before any job starts.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from conftest import qerl

TINY = ["quant=bf16", "tracker=disabled", "train.steps=2", "train.prompts_per_step=2", "algo.group_size=2",
        "monitor.every=0"]


def _span(run_dir: Path) -> tuple[float, float]:
    """When a job ran: Hydra writes .hydra/ in the job's process before the run; summary.json ends it."""
    return (run_dir / ".hydra" / "config.yaml").stat().st_mtime, (run_dir / "summary.json").stat().st_mtime


@pytest.mark.slow
def test_joblib_runs_the_jobs_in_parallel(tmp_path):
    out = qerl("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=0,1", *TINY, f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in out.stdout + out.stderr
    runs = sorted(p.parent for p in tmp_path.glob("*/summary.json"))
    assert [p.name for p in runs] == ["0_bf16_none_s0", "1_bf16_none_s1"]
    (start0, end0), (start1, end1) = _span(runs[0]), _span(runs[1])
    # The basic launcher runs job 1 after job 0 has finished; here each starts before the other ends.
    assert max(start0, start1) < min(end0, end1), (start0, end0, start1, end1)


@pytest.mark.slow
def test_submitit_local_runs_a_job(tmp_path):
    out = qerl("-m", "hydra/launcher=submitit_local", "seed=3", *TINY, f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "0_bf16_none_s3" / "summary.json").is_file()
    # submitit's own records: the job's log (our final line) and its pickled result, the job's return value.
    logs = list(tmp_path.glob(".submitit/*/*_0_log.out"))
    assert len(logs) == 1 and f"run dir: {tmp_path / '0_bf16_none_s3'}" in logs[0].read_text()
    result = pickle.loads(next(tmp_path.glob(".submitit/*/*_0_result.pkl")).read_bytes())
    assert result[0] == "success"


def test_unknown_launcher_is_one_line(tmp_path):
    out = qerl("-m", "hydra/launcher=slurm", "seed=0,1", *TINY, f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: hydra/launcher=slurm is not installed; choose one of: basic, joblib, submitit_local, submitit_slurm "
        "(joblib and submitit_local/submitit_slurm come with pip install 'qerl-exp[cluster]')"]
    assert not any(tmp_path.iterdir())
