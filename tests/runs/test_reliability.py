"""Faults: a killed or interrupted run resumes to the same metrics, corrupt checkpoints fall back,
NaN steps are skipped, a failing tracker degrades to offline, a run directory has one owner and
one config, a refused run writes nothing, and finished work is never lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qerl_exp
from conftest import ROOT, SUBPROCESS_ENV, TINY_RUN, kill_after, metrics_rows, qerl, stable, wait_for_steps

pytestmark = pytest.mark.slow

RUN = [*TINY_RUN, "train.steps=6", "checkpoint.every=1", "noise=exp", "noise.num_stages=3", "monitor.every=2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    out = qerl(*RUN, f"run_dir={run_dir}")
    assert out.returncode == 0, out.stderr[-2000:]
    return stable(metrics_rows(run_dir))


def _start(*args: str, env: dict | None = None) -> subprocess.Popen:
    """`python -m qerl_exp ARGS` in the background, with the same thread settings as `qerl`."""
    return subprocess.Popen([sys.executable, "-m", "qerl_exp", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**SUBPROCESS_ENV, **(env or {})})


# Kills after steps 2 and 4 are in the two tests below, which compare with the same run.
@pytest.mark.parametrize("kill_at", [1, 5])
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
    from qerl_exp.config.compose import compose

    return compose([*TINY_RUN, "monitor.every=0", f"model.cache_dir={os.path.expanduser('~/.cache/qerl_exp')}", *overrides])[0]


class _Stop(Exception):
    """Ends an in-process run after a step, as a pruner's `on_step` hook does."""


@pytest.fixture(scope="module")
def cut_short(tmp_path_factory) -> tuple[Path, list[dict]]:
    """An unfinished in-process run (steps 0-4 logged, checkpoints at steps 2 and 4) and its rows."""
    import qerl_exp.train as train

    def stop_after_4(step, metrics):
        if step == 4:
            raise _Stop

    run_dir = tmp_path_factory.mktemp("cut") / "run"
    with pytest.raises(_Stop):
        train.run(_in_process_cfg(None, *CUT_SHORT), run_dir, on_step=stop_after_4)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    return run_dir, metrics_rows(run_dir)


CUT_SHORT = ["train.steps=6", "checkpoint.every=2"]


def test_a_log_cut_mid_line_resumes_from_the_newest_checkpoint_it_covers(cut_short, tmp_path):
    import shutil

    import qerl_exp.train as train

    run_dir = tmp_path / "run"
    shutil.copytree(cut_short[0], run_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:25])  # the disk filled up in step 2
    with pytest.warns(UserWarning, match="holds steps 0-1 only, so the run continues from step_000002 and not from step_000004"):
        train.run(_in_process_cfg(None, *CUT_SHORT), run_dir)
    rows = metrics_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(6)), "steps lost or repeated"
    assert stable(rows[:5]) == stable(cut_short[1])


def test_a_checkpoint_under_another_config_than_config_json_is_refused(cut_short, tmp_path):
    import shutil

    import qerl_exp.train as train
    from qerl_exp.run import rundir

    run_dir = tmp_path / "run"
    shutil.copytree(cut_short[0], run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    config["train"]["lr"] = 1e-3  # edited by hand, and the command line says the same
    (run_dir / "config.json").write_text(json.dumps(config))
    before = _tree(run_dir)
    with pytest.raises(rundir.ConfigChangedError, match=r"step_000004 was written under another config .*train.lr: "):
        train.run(_in_process_cfg(None, *CUT_SHORT, "train.lr=1e-3"), run_dir)
    assert _tree(run_dir) == before


def test_nonfinite_loss_skips_the_update_then_stops_with_checkpoints_intact(tmp_path, monkeypatch):
    import qerl_exp.rl.learner as learner
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


def test_a_job_that_cannot_load_its_model_refuses_the_multirun_before_the_first_job(tmp_path):
    # job 1 asks for a checkpoint the hub cannot give (no weights here): known before any job runs
    out = qerl("-m", "model.name=tiny,no-such-org/no-such-model", *TINY_RUN, "train.steps=1", f"hydra.sweep.dir={tmp_path}",
               env={"HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
    assert "model.name='no-such-org/no-such-model' could not be loaded (the hub is unreachable" in out.stderr
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


# --------------------------------------------------------------------------- signals, ownership, refusals


@pytest.mark.parametrize("sig, threads", [(signal.SIGTERM, "1"), (signal.SIGINT, "2")])
def test_signal_checkpoints_the_step_and_prints_the_resume_command(tmp_path, uninterrupted, sig, threads):
    run_dir = tmp_path / "run"
    # checkpoint.every=0: the only checkpoint is the one the signal makes. The SIGINT run is long
    # enough to still own its directory when a second process tries it.
    longer = ["train.steps=500"] if sig == signal.SIGINT else []
    proc = _start(*RUN, *longer, "checkpoint.every=0", f"run_dir={run_dir}")
    wait_for_steps(proc, run_dir, 2)
    if sig == signal.SIGINT:  # a second process is refused while the first owns the directory
        other = qerl(*RUN, "seed=1", f"run_dir={run_dir}")
        assert other.returncode == 1 and f"in use by process {proc.pid}" in other.stderr, other.stderr[-2000:]
        assert other.stderr.count("\n") == 1
    assert proc.poll() is None, "the run ended before the signal"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert f"interrupted by {sig.name}" in last and "checkpointed" in last, last
    resume = last.split("resume with: python -m qerl_exp ")[1].split()
    assert resume == [f"resume={run_dir}"]
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))
    done = len(metrics_rows(run_dir))
    assert len(ckpt) == 1 and int(ckpt[0].name[5:]) == done
    if threads == "1":  # the same thread count as the uninterrupted run: the same metrics
        out = qerl(*resume)
        assert out.returncode == 0, out.stderr[-2000:]
        assert stable(metrics_rows(run_dir)) == uninterrupted
        assert "thread" not in out.stderr
    else:  # another thread count is named, since the last bits may differ from here on; one more step, then stop
        again = _start(*resume, env={"OMP_NUM_THREADS": threads})
        wait_for_steps(again, run_dir, done + 1)
        again.send_signal(sig)
        _, err = again.communicate(timeout=300)
        assert again.returncode == 128 + sig and "written by a run with 1 CPU thread(s), resumed with 2" in err, err[-2000:]
        assert [r["step"] for r in metrics_rows(run_dir)][:done + 1] == list(range(done + 1))


def _tree(path: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


def _ghosts() -> set[Path]:
    return set((ROOT / "runs").glob("*/*"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step run made with run_dir=, and the ghost dirs Hydra made meanwhile (none)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    before = _ghosts()
    out = qerl(*TINY_RUN, "train.steps=2", f"run_dir={run_dir}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert _ghosts() == before, "a run_dir= run left a Hydra output dir under runs/"
    return run_dir


def test_run_dir_holds_hydra_record(finished):
    overrides = (finished / ".hydra" / "overrides.yaml").read_text()
    assert f"run_dir={finished}" in overrides and "train.steps=2" in overrides
    assert "seed: 0" in (finished / ".hydra" / "config.yaml").read_text()


def test_refused_runs_write_nothing(finished):
    before, ghosts = _tree(finished), _ghosts()
    for args in ([f"hydra.run.dir={finished}", "quant=mxfp4", "seed=3"], [f"run_dir={finished}", "seed=3"],
                 [f"resume={finished}"]):
        out = qerl(*TINY_RUN, "train.steps=2", *args)
        assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr[-2000:]
        assert f"{finished} holds a finished run" in out.stderr
    assert _tree(finished) == before
    assert _ghosts() == ghosts


def test_rerun_or_resume_with_another_config_or_length_is_refused_then_resumed(finished, tmp_path):
    import shutil

    run_dir = tmp_path / "unfinished"
    shutil.copytree(finished, run_dir)
    (run_dir / "summary.json").unlink()
    before = _tree(run_dir)
    out = qerl(*TINY_RUN, "train.steps=2", f"run_dir={run_dir}", "quant=nvfp4")
    assert out.returncode == 1 and "another config (quant.format: 'none' -> 'nvfp4')" in out.stderr, out.stderr[-2000:]
    # nor its length: the learning-rate and noise schedules span train.steps
    out = qerl(f"resume={run_dir}", "lora.r=32", "seed=2", "train.steps=3")
    assert out.returncode == 1, out.stderr[-2000:]
    assert "the overrides change lora.r: 16 -> 32; seed: 0 -> 2; train.steps: 2 -> 3; a run keeps its length" in out.stderr
    assert out.stderr.count("\n") == 1
    assert _tree(run_dir) == before
    # it keeps the commit that started the run (here another one's), and summary.json gets the one
    # that finished it
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "commit": "c0ffee"}))
    out = qerl(f"resume={run_dir}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((run_dir / "config.json").read_text())["commit"] == "c0ffee"
    assert json.loads((run_dir / "summary.json").read_text())["commit"] == _commit(SUBPROCESS_ENV)
    assert [r["step"] for r in metrics_rows(run_dir)] == [0, 1]


def _commit(env: dict) -> str:
    code = "from qerl_exp.run.record import source_commit; print(source_commit())"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_commit_comes_from_the_environment_or_else_from_git(tmp_path):
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    version = f"v{qerl_exp.__version__}"
    assert _commit(SUBPROCESS_ENV).removesuffix("-dirty") == (git.stdout.strip() if git.returncode == 0 else version)
    # a copy whose git data names another commit (a GPU machine's) is named by QERL_COMMIT
    assert _commit({**SUBPROCESS_ENV, "QERL_COMMIT": "c0ffee"}) == "c0ffee"
    copy = {**SUBPROCESS_ENV, "GIT_DIR": str(tmp_path / "no-repository")}  # git finds no checkout
    assert _commit({**copy, "QERL_COMMIT": "a051848"}) == "a051848"
    assert _commit(copy) == version  # a copy of the tree without its git folder


def test_each_eval_writes_its_own_file(finished, tmp_path):
    import shutil

    from qerl_exp.config import EvalConfig
    from qerl_exp.eval.__main__ import EvalCommand, evaluate_run

    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    settings = [dict(eval=EvalConfig(k=2, max_new_tokens=8), limit=3), dict(eval=EvalConfig(k=0, max_new_tokens=8), limit=2)]
    for i, kwargs in enumerate(settings):
        args = EvalCommand(run_dir=str(run_dir), device="cpu", tracker="disabled", **kwargs)
        evaluate_run(args)
        assert args.out == ("eval.json" if i == 0 else "eval-2.json")
    first, second = (json.loads((run_dir / n).read_text()) for n in ("eval.json", "eval-2.json"))
    assert first["args"]["eval"]["k"] == 2 and len(first["problems"]) == 3
    assert second["args"]["eval"]["k"] == 0 and len(second["problems"]) == 2
    with pytest.raises(ValueError, match="exists, and an evaluation writes only a new file"):
        evaluate_run(EvalCommand(run_dir=str(run_dir), out="eval.json", **settings[1]))


def test_truncated_adapter_is_named(finished, tiny_policy):
    from qerl_exp.run.checkpoint import ADAPTER_FILE, load_adapter

    path = finished.parent / "truncated"
    path.mkdir()
    (path / ADAPTER_FILE).write_bytes((finished / "final" / "adapter" / ADAPTER_FILE).read_bytes()[:100])
    with pytest.raises(ValueError, match=f"{path / ADAPTER_FILE} is not a readable safetensors file"):
        load_adapter(tiny_policy[2].policy, path)


def test_ctrl_c_during_eval_is_one_line_and_leaves_no_file(finished, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    proc = subprocess.Popen([sys.executable, "-m", "qerl_exp.eval", f"run_dir={run_dir}", "k=8", "n=16", "tracker=disabled"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=SUBPROCESS_ENV)
    for line in proc.stderr:  # until the first progress line: the evaluation is under way
        if line.startswith("eval seq"):
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "error: interrupted; an evaluation file is written only when the evaluation finishes"
    assert not list(run_dir.glob("eval*.json"))


def _can_mount(tmp_path) -> bool:
    return subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {tmp_path}"],
                          capture_output=True).returncode == 0


def test_full_disk_and_read_only_places_end_in_one_line_and_leave_a_resumable_run(finished, tmp_path):
    """A 300 KiB file system fills up at the first checkpoint; a read-only one refuses the run dir, is
    a HOME whose model cache is named, and a run dir that eval refuses before evaluating anything."""
    import shutil

    mnt, ro, ro_run = tmp_path / "mnt", tmp_path / "ro", tmp_path / "ro_run"
    mnt.mkdir(), ro.mkdir()
    shutil.copytree(finished, ro_run)
    if not _can_mount(mnt):
        pytest.skip("needs a private mount namespace (unshare -m) to make a small or read-only file system")
    full_args = " ".join([*TINY_RUN, "train.steps=3", "checkpoint.every=1", f"run_dir={mnt}/run"])
    ro_args = " ".join([*TINY_RUN, f"run_dir={ro}/run"])
    script = (f"mount -t tmpfs -o size=300k tmpfs {mnt} && mount -t tmpfs -o ro,size=64k tmpfs {ro} && "
              f"mount --bind {ro_run} {ro_run} && mount -o remount,bind,ro {ro_run} && "
              f"{sys.executable} -m qerl_exp {full_args} 2>{tmp_path}/full.err; echo $? > {tmp_path}/full.rc; "
              f"cp -r {mnt}/run {tmp_path}/copy; "
              f"{sys.executable} -m qerl_exp {ro_args} 2>{tmp_path}/ro.err; echo $? > {tmp_path}/ro.rc; "
              f"HOME={ro} {sys.executable} -m qerl_exp {' '.join(TINY_RUN)} run_dir={tmp_path}/run "
              f"2>{tmp_path}/home.err; echo $? > {tmp_path}/home.rc; "
              f"{sys.executable} -m qerl_exp.eval run_dir={ro_run} k=2 2>{tmp_path}/eval.err; echo $? > {tmp_path}/eval.rc")
    subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, env=SUBPROCESS_ENV, timeout=600)
    full_err = (tmp_path / "full.err").read_text().strip().splitlines()
    assert (tmp_path / "full.rc").read_text().strip() == "1", full_err[-20:]
    assert "Traceback" not in "\n".join(full_err)
    assert f"cannot write {mnt}/run/" in full_err[-1] and "the disk is full" in full_err[-1], full_err[-1]
    ro_err = (tmp_path / "ro.err").read_text().strip().splitlines()
    assert len(ro_err) == 1 and f"{ro}/run" in ro_err[0] and "read-only" in ro_err[0], ro_err
    assert (tmp_path / "ro.rc").read_text().strip() == "2"
    home_err = (tmp_path / "home.err").read_text().strip().splitlines()
    assert home_err == [f"error: cannot write {ro}/.cache/qerl_exp: the file system is read-only; "
                        "choose a writable model.cache_dir"], home_err
    assert (tmp_path / "home.rc").read_text().strip() == "2" and not (tmp_path / "run").exists()
    eval_err = (tmp_path / "eval.err").read_text().strip().splitlines()  # no progress line: nothing was evaluated
    assert eval_err == [f"error: cannot write {ro_run}: the file system is read-only; choose a writable path (out=...)"], eval_err
    assert (tmp_path / "eval.rc").read_text().strip() == "1"
    # What the full disk left is whole: the run continues from it on a disk with room.
    copy = tmp_path / "copy"
    assert not list(copy.rglob(".step_*")) and not list(copy.rglob(".*-*"))
    out = qerl(*TINY_RUN, "train.steps=3", "checkpoint.every=1", f"run_dir={copy}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert [r["step"] for r in metrics_rows(copy)] == [0, 1, 2]


def test_blown_up_weights_reach_the_nonfinite_guard(tmp_path):
    import qerl_exp.train as train

    cfg = _in_process_cfg(tmp_path, "train.steps=5", "train.lr=1e30", "train.max_nonfinite=2", "checkpoint.every=1")
    run_dir = tmp_path / "run"
    with pytest.raises(train.NonFiniteError, match=r"2 consecutive steps .* lower train.lr \(now 1e\+30\) or the noise sigma"):
        train.run(cfg, run_dir)
    rows = metrics_rows(run_dir)
    assert [r["train/skipped"] for r in rows][-2:] == [1, 1]



# --------------------------------------------------------------------------- your own task under hostile input

# A run on a checkpoint folder, short enough for CI; rewards the user's.
OWN = ["task=dataset", "tracker.mode=disabled", "train.steps=1", "train.prompts_per_step=2", "algo.group_size=2",
       "algo.max_new_tokens=8", "eval.max_new_tokens=8", "task.eval_size=4", "monitor.every=0", "task.system_prompt=''"]


def _in(folder: Path, *args: str, module: str = "qerl_exp") -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` run in `folder`, as a researcher runs it from theirs (this tree's code)."""
    env = {**SUBPROCESS_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=folder, capture_output=True, text=True, timeout=600,
                          env=env)


def _own_folder(folder: Path, reward: str) -> Path:
    """A researcher's folder: `data.jsonl` (text prompts and a `level` column) and `rw/rewards.py:score`
    (`reward`, the body of its function), which imports its neighbour `rw/helper.py`."""
    folder.mkdir(parents=True)
    (folder / "data.jsonl").write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i),
                                                           "level": i % 3}) + "\n" for i in range(16)))
    (folder / "rw").mkdir()
    (folder / "rw" / "helper.py").write_text("def length(text):\n    return len(text) / 10\n")
    (folder / "rw" / "rewards.py").write_text(f"import sys\n\nfrom helper import length\n\n\n"
                                              f"def score(prompts, completions, level, **kwargs):\n    {reward}\n")
    return folder


@pytest.fixture(scope="module")
def own_run(tmp_path_factory) -> tuple[Path, Path]:
    """`(folder, checkpoint)`: a finished run made in `folder` with paths relative to it (the data, the
    reward file, the run dir `run`) on a checkpoint folder."""
    from conftest import save_checkpoint

    root = tmp_path_factory.mktemp("own")
    checkpoint = save_checkpoint(root / "checkpoint")
    folder = _own_folder(root / "work", "return [length(c[0]['content'] if isinstance(c, list) else c) for c in completions]")
    out = _in(folder, f"model.name={checkpoint}", *OWN, "task.path=data.jsonl", "task.reward_funcs=[rw/rewards.py:score]",
              "run_dir=run")
    assert out.returncode == 0, out.stderr[-3000:]
    return folder, checkpoint


def test_a_run_records_its_paths_resolved_and_is_evaluated_and_exported_from_any_folder(own_run, tmp_path):
    folder, _ = own_run
    config = json.loads((folder / "run" / "config.json").read_text())
    assert config["task"]["path"] == str(folder / "data.jsonl")
    assert config["task"]["reward_funcs"] == [f"{folder}/rw/rewards.py:score"]
    assert config["reward_files"]["score"]["imports"] == {"helper.py": _sha16(folder / "rw" / "helper.py")}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = _in(elsewhere, f"run_dir={folder / 'run'}", "limit=2", "k=1", f"out={tmp_path / 'eval.json'}", module="qerl_exp.eval")
    assert out.returncode == 0, out.stderr[-3000:]
    out = _in(elsewhere, f"run_dir={folder / 'run'}", f"out={tmp_path / 'export'}", module="qerl_exp.export")
    assert out.returncode == 0 and (tmp_path / "export" / "adapter_model.safetensors").is_file(), out.stderr[-3000:]


def test_a_record_of_paths_as_typed_still_evaluates_from_its_folder(own_run, tmp_path):
    import shutil

    folder, _ = own_run
    copy = folder.parent / "typed"  # beside the run, as an older version recorded it: paths relative to its folder
    shutil.copytree(folder, copy)
    config = json.loads((copy / "run" / "config.json").read_text())
    config["task"].update(path="data.jsonl", reward_funcs=["rw/rewards.py:score"])
    config["reward_files"]["score"] = {"file": "rw/rewards.py", "sha256": config["reward_files"]["score"]["sha256"]}
    (copy / "run" / "config.json").write_text(json.dumps(config))
    out = _in(copy, "run_dir=run", "limit=2", "k=1", f"out={tmp_path / 'eval.json'}", module="qerl_exp.eval")
    assert out.returncode == 0, out.stderr[-3000:]


def _sha16(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def test_a_base_that_changed_after_the_run_is_refused_by_eval_and_export(own_run, tmp_path):
    import shutil

    from conftest import save_checkpoint

    folder, checkpoint = own_run
    base, run_dir = tmp_path / "base", tmp_path / "run"
    shutil.copytree(checkpoint, base)  # the same names and bytes: the base the run recorded
    shutil.copytree(folder / "run", run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    config["model"]["name"] = str(base)
    (run_dir / "config.json").write_text(json.dumps(config))
    save_checkpoint(base, seed=1)  # new weights in the run's checkpoint folder (a re-download, a moved "latest" link)
    before = _tree(run_dir)
    line = (f"the base model's files (model.name={base}) changed since the run was trained (their sha256 differs from "
            "the one in config.json): its adapter would be applied to another base; restore them")
    out = _in(folder, f"run_dir={run_dir}", "limit=2", "k=1", module="qerl_exp.eval")  # from the run's own folder
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [f"error: ValueError: {line}"], out.stderr[-3000:]
    out = _in(folder, f"run_dir={run_dir}", f"out={tmp_path / 'merged'}", "merge=bf16", module="qerl_exp.export")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [f"error: {line}"], out.stderr[-3000:]
    assert _tree(run_dir) == before and not (tmp_path / "merged").exists()


def test_a_run_no_reward_function_ever_scores_finishes_with_one_line_and_its_summary(tmp_path):
    from conftest import save_checkpoint

    checkpoint = save_checkpoint(tmp_path / "checkpoint")
    folder = _own_folder(tmp_path / "work", "return [None for _ in completions]")
    out = _in(folder, f"model.name={checkpoint}", *OWN, "train.steps=2", "task.path=data.jsonl",
              "task.reward_funcs=[rw/rewards.py:score]", "run_dir=run")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == (
        "run dir: run  final reward: none (no reward function scored any completion at any step: each "
        "returned None; check task.reward_funcs against the data's columns)")
    summary = json.loads((folder / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["reward/final"] is None and summary["reward/best"] is None


def test_a_reward_function_that_exits_ends_the_run_in_one_line(tmp_path):
    from conftest import save_checkpoint

    checkpoint = save_checkpoint(tmp_path / "checkpoint")
    folder = _own_folder(tmp_path / "work", "sys.exit(0)")
    out = _in(folder, f"model.name={checkpoint}", *OWN, "task.path=data.jsonl", "task.reward_funcs=[rw/rewards.py:score]",
              "run_dir=run")
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        f"error: RewardError: reward function score ({folder}/rw/rewards.py:score) ended the program at step 0: "
        "SystemExit(0): it called sys.exit (or a library did for it); raise an exception instead (traceback in "
        "run/error.txt)"]
    assert not (folder / "run" / "summary.json").exists()


def test_a_file_in_the_working_directory_named_like_a_library_is_not_run_in_its_place(tmp_path):
    (tmp_path / "datasets.py").write_text("raise SystemExit('the data-prep script ran')\n")  # as docs lay a folder out
    (tmp_path / "data.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "", "answer": "3"}\n')
    out = _in(tmp_path, *OWN, "task.path=data.jsonl")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [  # the data read by the library `datasets`
        f"error: {tmp_path / 'data.jsonl'}: 1 malformed line: line 2: column 'prompt' (the prompt) must be non-empty "
        "text or a list of {role, content} messages with text content, got str"], out.stderr[-2000:]


def test_a_second_study_in_a_used_sweep_dir_is_refused_and_the_first_is_left_as_it_was(tmp_path):
    import yaml

    spec = {"base": ["quant=bf16", "tracker=disabled", "train.steps=1", "train.prompts_per_step=2", "algo.group_size=2",
                     "monitor.every=0"],
            "params": {"noise.sigma": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
            "objective": {"metric": "reward"}, "n_trials": 1}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({**spec, "base": [*spec["base"][:2], "train.steps=2", *spec["base"][3:]]}))
    sweep_dir = tmp_path / "D"
    out = _in(tmp_path, "a.yaml", f"sweep_dir={sweep_dir}", module="qerl_exp.sweep")
    assert out.returncode == 0 and (sweep_dir / "trials" / "trial0000_s0" / "summary.json").is_file(), out.stderr[-3000:]
    before = _tree(sweep_dir)
    out = _in(tmp_path, "b.yaml", "study_name=b", f"sweep_dir={sweep_dir}", module="qerl_exp.sweep")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: sweep_dir={sweep_dir} holds the trials of study 'a' in sqlite:///{sweep_dir}/study.db, not of this 'b' in "
        f"sqlite:///{sweep_dir}/study.db; give this study its own sweep_dir="], out.stderr[-3000:]
    assert _tree(sweep_dir) == before  # its storage (and the storage's lock file) untouched
