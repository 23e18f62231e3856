"""Nothing destroyed, mixed or stranded by a tool: `analysis keep` removes only what it wrote and
refuses a destination inside its source; analysis reads each run once whatever names it (a link, a
copy, its W&B file) and writes no report into a run; a tracker fault never ends a run; a multirun
ends in one line per failed job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conftest import ROOT, SUBPROCESS_ENV, TINY_RUN
from qerl_exp.config import Config, TrackerConfig, as_dict


def _run(path: Path, seed: int = 0, wall: float = 1.0) -> Path:
    """A finished 2-step run record; `wall` sets its wall times (what tells two processes apart)."""
    path.mkdir(parents=True)
    config = {**as_dict(Config(seed=seed)), "choices": {"config": "fp"}}
    config["train"]["steps"] = 2
    config["monitor"]["every"] = 0
    (path / "config.json").write_text(json.dumps(config))
    rows = [{"step": s, "reward": 1.0, "entropy": 0.1, "sampler/entropy": 0.1, "noise/sigma": 0.0,
             "perf/rollout_tok_s": 100.0, "perf/step_s": wall + s, "mem/weights_bytes": 1.0, "mem/peak_bytes": 1.0}
            for s in range(2)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text("{}")
    return path


def _tree(path: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


def test_keep_never_removes_what_it_did_not_write(tmp_path, capsys):
    from analysis.__main__ import main

    sweep = tmp_path / "sweep"
    trial = _run(sweep / "trials" / "trial0000_s0")
    (trial / "final" / "adapter").mkdir(parents=True)
    (trial / "final" / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    (trial / "checkpoints" / "step_000001").mkdir(parents=True)
    before = _tree(sweep)
    for dest in (sweep / "trials", sweep / "kept", sweep):  # inside the source: refused, whatever the depth
        assert main(["keep", str(sweep), str(dest)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: DEST {dest} is inside SWEEP_DIR {sweep}: the records would replace or mix with the trials "
                       "they are copied from; give a DEST outside it"]
    link = tmp_path / "link"
    link.symlink_to(sweep / "trials")
    assert main(["keep", str(sweep), str(link)]) == 1  # a link into it too
    capsys.readouterr()
    dest = tmp_path / "dest"
    (dest / "fp_s0" / "final").mkdir(parents=True)  # a run (not a kept record) under the record's name
    _run(tmp_path / "run")
    (tmp_path / "file").write_text("")
    assert main(["keep", str(sweep), str(dest)]) == 1
    assert capsys.readouterr().err.startswith(f"error: {dest / 'fp_s0'} holds other files than a record")
    assert (dest / "fp_s0" / "final").is_dir() and _tree(sweep) == before
    for bad, message in ((trial / "kept", f"DEST {trial / 'kept'} is inside SWEEP_DIR"),  # also: in a run
                         (tmp_path / "run" / "kept", f"DEST {tmp_path / 'run' / 'kept'} is in the run directory"),
                         (tmp_path / "file", f"DEST {tmp_path / 'file'} is a file, not a directory")):
        assert main(["keep", str(sweep), str(bad)]) == 1 and capsys.readouterr().err.startswith(f"error: {message}")
    (dest / "fp_s0" / "final").rmdir()
    assert main(["keep", str(sweep), str(dest)]) == 0 and main(["keep", str(sweep), str(dest)]) == 0  # a record: replaced
    assert sorted(p.name for p in dest.iterdir()) == ["fp_s0"]
    assert _tree(sweep) == before


def test_analysis_reads_each_run_once_whatever_names_it(tmp_path, capsys):
    import shutil

    from analysis import determinism
    from analysis.runs import load

    a, b = _run(tmp_path / "runs" / "a", wall=1.0), _run(tmp_path / "runs" / "b", wall=1.5)
    (tmp_path / "runs" / "alias_of_a").symlink_to(a)
    shutil.copytree(a, tmp_path / "copy_of_a")
    loaded = load([str(a), str(tmp_path / "runs" / "alias_of_a"), str(b), str(tmp_path / "runs"),
                   str(tmp_path / "runs" / ".." / "runs" / "a"), str(tmp_path / "copy_of_a")], presets={})
    assert sorted(r.source for r in loaded.runs) == [str(a), str(b)]
    assert dict(loaded.skipped)[str(tmp_path / "copy_of_a")].startswith(f"the same run as {a} (a copy or another path")
    for twin in (tmp_path / "copy_of_a", tmp_path / "runs" / "alias_of_a"):  # no false "identical in every metric"
        assert determinism.main([str(a), str(twin)]) == 1
        assert capsys.readouterr().err.startswith(f"error: {a} and {twin} are one run (a copy or another path to it")
    assert determinism.main([str(a), str(b)]) == 0  # two processes: other wall times


def test_analysis_writes_no_report_into_a_run_and_refuses_in_one_line(tmp_path, capsys):
    from analysis.__main__ import main

    run = _run(tmp_path / "runs" / "a")
    before = _tree(run)
    assert main([str(run), "--out", str(run / "report")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --out {run / 'report'} is in the run directory {run}: the report "
                                               "would mix with the run's files; give a folder outside it (by default: "
                                               "report/ beside the runs)")
    assert main([str(run), "--into", str(tmp_path / "page.md")]) == 2  # checked before any run is read or written
    assert capsys.readouterr().err.strip().startswith(f"error: --into {tmp_path / 'page.md'} cannot be read")
    for args in ([str(run), "--smooth", "0"], ["determinism", str(run)]):  # argparse's errors, in one line too
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    assert _tree(run) == before and not (tmp_path / "runs" / "report").exists()


def test_wandb_that_cannot_stage_a_table_or_write_its_home_folders_never_ends_a_run(tmp_path, monkeypatch):
    from qerl_exp.run.tracking import Tracker

    home = tmp_path / "home"
    home.mkdir()
    for folder in (".local", ".cache", ".config"):  # files where W&B's folders belong: nothing writable there
        (home / folder).write_text("")
    monkeypatch.setenv("HOME", str(home))
    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "XDG_CACHE_HOME", "XDG_DATA_HOME",
                "XDG_CONFIG_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback needed: W&B's folders moved into the run
        tracker = Tracker(run_dir, TrackerConfig(mode="offline"), {"seed": 0}, name="t", group="g", job_type="train", tags=[])
        tracker.log(0, {"reward": 1.0})
        tracker.log_completions(0, [{"step": 0, "prompt": "1+1=", "completion": "<answer>2</answer>",
                                     "rewards": {"correct": 2.0}, "reward": 2.0, "advantage": 0.0}])  # W&B stages the table in its data folder
    assert os.environ["WANDB_DATA_DIR"].startswith(str(run_dir / "wandb"))

    def broken(*args, **kwargs):
        raise PermissionError("Unable to write staging files")

    monkeypatch.setattr(tracker.wandb, "log", broken)
    with pytest.warns(UserWarning, match="W&B failed .*; logging to metrics.jsonl only from here on"):
        tracker.log(1, {"reward": 2.0})
    tracker.log(2, {"reward": 3.0})
    tracker.finish({"reward/final": 3.0})
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert (run_dir / "summary.json").exists()


@pytest.mark.slow
def test_a_multirun_ends_with_one_line_per_failed_job_and_no_traceback(tmp_path):
    # job 1's weights blow up (lr 1e30): it fails at run time, after job 0 has finished
    out = subprocess.run([sys.executable, "-m", "qerl_exp", *TINY_RUN, "train.steps=5", "train.max_nonfinite=2",
                          "monitor.every=0", "train.lr=0.002,1e30", f"hydra.sweep.dir={tmp_path}", "-m"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=SUBPROCESS_ENV)
    assert out.returncode == 1 and "Traceback" not in out.stderr and "Error executing job" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: job 1 failed: NonFiniteError: 2 consecutive steps")
    assert out.stderr.strip().splitlines()[-1] == errors[0]
    assert (tmp_path / "0_bf16_none_s0" / "summary.json").exists()


def test_a_held_run_dir_refuses_the_multirun_before_its_first_job(tmp_path):
    from qerl_exp.run import rundir
    from qerl_exp.cli import Refused, validate
    from qerl_exp.config.compose import compose
    from qerl_exp.train import run_config

    job = [*TINY_RUN, "train.steps=1"]
    held = rundir.claim(tmp_path / "b", run_config(*compose([*job, f"run_dir={tmp_path / 'b'}"])))  # job 1's, in use
    with pytest.raises(Refused, match=f"^{tmp_path / 'b'} is in use by process {os.getpid()}"):
        validate([*job, f"run_dir={tmp_path / 'a'},{tmp_path / 'b'}"], multirun=True)
    held.release()
    assert not (tmp_path / "a").exists()
