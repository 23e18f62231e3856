"""A sweep dir holds the trials of one study: a trial of another study never takes a run it finds
there, whatever way it got in, and nothing of the first study changes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from optuna.trial import TrialState

from qerl_exp.run.console import UsageError
from qerl_exp.run.signals import StopSignals
from qerl_exp.sweep.spec import load_plan
from qerl_exp.sweep.study import open_storage, open_study, run_trial

SPEC = {"base": ["quant=bf16", "tracker=disabled", "train.steps=1", "train.prompts_per_step=2", "algo.group_size=2",
                 "monitor.every=0"],
        "params": {"noise.sigma": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
        "objective": {"metric": "reward"}, "n_trials": 1}


def _tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*"))
            if p.is_file()}


def test_a_trial_never_takes_the_run_another_study_left_in_its_sweep_dir(tmp_path):
    sweep_dir = tmp_path / "D"
    trial_dir = sweep_dir / "trials" / "trial0000_s0"  # study a's finished trial 0, as its worker left it
    trial_dir.mkdir(parents=True)
    (trial_dir / "config.json").write_text(json.dumps({"train": {"steps": 1}, "model": {}, "choices": {"study": "a", "trial": "0"}}))
    (trial_dir / "metrics.jsonl").write_text('{"step": 0, "reward": 9.0}\n')
    (trial_dir / "summary.json").write_text('{"reward/final": 9.0}')
    before = _tree(trial_dir)
    b = load_plan(tmp_path / "b.yaml", ["study_name=b", f"sweep_dir={sweep_dir}"], spec=SPEC)
    storage = open_storage(b)
    study = open_study(b, storage, create=True)
    trial = study.ask()
    with pytest.raises(UsageError) as e:
        run_trial(b, study, storage, trial, StopSignals(), log=lambda line: None)
    assert str(e.value) == (f"{trial_dir} holds a run of study 'a', not of this study 'b': sweep_dir={sweep_dir} holds "
                            "another study's trials; give study 'b' its own sweep_dir=")
    assert study.get_trials()[0].state == TrialState.FAIL  # not study a's reward
    assert _tree(trial_dir) == before
