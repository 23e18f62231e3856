"""Faults: a killed run resumes to the same metrics, corrupt checkpoints fall back, NaN steps are
skipped, a failing tracker degrades to offline, and finished work is never lost."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import TINY_RUN, kill_after, metrics_rows, qerl, stable

pytestmark = pytest.mark.slow

RUN = [*TINY_RUN, "train.steps=6", "checkpoint.every=1", "noise=exp", "noise.num_stages=3", "monitor.every=2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    out = qerl(*RUN, f"run_dir={run_dir}")
    assert out.returncode == 0, out.stderr[-2000:]
    return stable(metrics_rows(run_dir))


@pytest.mark.parametrize("kill_at", [1, 3, 5])
def test_sigkill_then_resume_equals_uninterrupted(tmp_path, uninterrupted, kill_at):
    run_dir = tmp_path / "run"
    kill_after(RUN, run_dir, kill_at)
    out = qerl(*RUN, f"run_dir={run_dir}")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = metrics_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(6)), "duplicate or missing steps after resume"
    assert stable(rows) == uninterrupted


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    kill_after(RUN, run_dir, 4)
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    (newest / "state.pt").write_bytes(b"not a checkpoint")
    out = qerl(*RUN, f"run_dir={run_dir}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"checkpoint {newest} is unreadable" in out.stderr
    assert stable(metrics_rows(run_dir)) == uninterrupted


def test_resume_flag_continues_with_the_saved_config(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    kill_after(RUN, run_dir, 2)
    out = qerl(f"resume={run_dir}", "tracker.mode=disabled")
    assert out.returncode == 0, out.stderr[-2000:]
    assert stable(metrics_rows(run_dir)) == uninterrupted


def _in_process_cfg(tmp_path, *overrides):
    from qerl_exp.cli import compose_config
    from qerl_exp.config import to_config

    return to_config(compose_config([*TINY_RUN, "monitor.every=0", f"model.cache_dir={os.path.expanduser('~/.cache/qerl_exp')}", *overrides]))


def test_nonfinite_loss_skips_the_update_then_stops_with_checkpoints_intact(tmp_path, monkeypatch):
    import qerl_exp.learner as learner
    import qerl_exp.train as train

    real = learner.policy_loss
    calls = {"n": 0}

    def nan_after_two(*args, **kwargs):  # fault injection: the loss turns NaN from the third step on
        per_token, ratio = real(*args, **kwargs)
        calls["n"] += 1
        return (per_token * float("nan") if calls["n"] > 2 else per_token), ratio

    monkeypatch.setattr(learner, "policy_loss", nan_after_two)
    cfg = _in_process_cfg(tmp_path, "train.steps=8", "checkpoint.every=1", "train.max_nonfinite=3")
    run_dir = tmp_path / "run"
    with pytest.raises(train.NonFiniteError, match="3 consecutive steps"):
        train.run(cfg, run_dir)
    rows = metrics_rows(run_dir)
    assert [r["train/skipped"] for r in rows] == [0, 0, 1, 1, 1]
    # the skipped steps left the adapter as it was after step 1
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == ["step_000003", "step_000004"]
    from safetensors.torch import load_file

    a = load_file(str(ckpts[0] / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(ckpts[1] / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not (run_dir / "summary.json").exists()


def test_tracker_whose_online_init_raises_falls_back_to_offline(tmp_path, monkeypatch):
    import wandb

    import qerl_exp.train as train

    real_init = wandb.init

    def unreachable(*args, mode=None, **kwargs):  # the W&B server is a network edge we cannot reach
        if mode == "online":
            raise wandb.errors.CommError("could not reach api.wandb.ai")
        return real_init(*args, mode=mode, **kwargs)

    monkeypatch.setattr(wandb, "init", unreachable)
    cfg = _in_process_cfg(tmp_path, "train.steps=2", "tracker.mode=online")
    run_dir = tmp_path / "run"
    with pytest.warns(UserWarning, match="logging offline instead"):
        summary = train.run(cfg, run_dir)
    assert summary["steps"] == 2
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_failed_job_in_a_multirun_keeps_its_siblings(tmp_path):
    # job 1 asks for a checkpoint the hub cannot give (no weights here): it fails, job 0 finishes
    out = qerl("-m", "model.name=tiny,no-such-org/no-such-model", *TINY_RUN, "train.steps=1", f"hydra.sweep.dir={tmp_path}")
    assert out.returncode != 0
    assert (tmp_path / "0_bf16_none_s0" / "summary.json").exists()
    assert "could not be loaded" in out.stderr
