"""Optuna sweeps (`python -m qerl_exp.sweep`): specs, one-line errors, resume after Ctrl-C and
SIGKILL, the end-of-study reports, and pruning through the run loop's `on_step` hook.

Trials are tiny (bf16 base, 2 prompts x 2 completions, monitor off, W&B disabled) and reuse the
embedded model's cached warm-up in `~/.cache/qerl_exp` (made once, about 2 minutes, by whichever
test first needs it; a file lock keeps parallel workers from making it twice).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from conftest import ROOT, SUBPROCESS_ENV
from qerl_exp.run.console import UsageError
from qerl_exp.sweep.spec import Objective, load_plan, merge_overrides, override

os.environ["WANDB_MODE"] = "disabled"
optuna.logging.set_verbosity(optuna.logging.WARNING)

TINY = ["quant=bf16", "tracker=disabled", "train.prompts_per_step=2", "algo.group_size=2", "monitor.every=0"]
SPEC = ROOT / "sweeps" / "noise_schedule.yaml"


def sweep_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "qerl_exp.sweep", *args]


def sweep(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(sweep_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=SUBPROCESS_ENV)


def write_spec(tmp_path: Path, **fields) -> Path:
    spec = {"base": ["train.steps=2"], "params": {"noise.sigma": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
            "objective": {"metric": "reward"}, "n_trials": 2, **fields}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def load(db: Path, name: str) -> optuna.Study:
    # skip_table_creation: never race the sweep that creates the tables of a fresh storage
    storage = optuna.storages.RDBStorage(f"sqlite:///{db}", skip_table_creation=True)
    return optuna.load_study(study_name=name, storage=storage)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the sweep exited ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def safe_trials(db: Path, name: str) -> list:
    try:
        return load(db, name).get_trials(deepcopy=False)
    except Exception:  # noqa: BLE001 - the study may not exist yet, or the file is busy
        return []


def running_mid_trial(db: Path, name: str, min_finished: int):
    """A RUNNING trial that has reported at least one step, once `min_finished` trials finished."""
    trials = safe_trials(db, name)
    if sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials) < min_finished:
        return None
    return next((t for t in trials if t.state == TrialState.RUNNING and t.intermediate_values
                 and "worker_pid" in t.user_attrs), None)


# ---------------------------------------------------------------------------------------------
# Specs and one-line errors (no training)


@pytest.mark.slow
def test_shipped_specs_validate_against_the_config():
    plan = load_plan(SPEC, ["n_trials=6", "train.steps=6"])
    assert plan.study_name == "noise_schedule" and plan.n_trials == 6 and plan.pruner["name"] == "median"
    assert plan.storage == f"sqlite:///{Path.cwd() / 'sweeps/runs/noise_schedule/study.db'}"  # relative to the cwd
    assert "train.steps=6" in plan.overrides and "train.steps=60" not in plan.overrides
    multi = load_plan(ROOT / "sweeps" / "multi_objective.yaml", [])
    assert multi.directions == ["maximize", "maximize"] and multi.pruner["name"] == "none"
    assert multi.params[-1].when == {"noise": ["exp"]}
    smol = load_plan(ROOT / "sweeps" / "smollm2.yaml", [])
    assert smol.grid and smol.n_trials == 12 and "model=smollm2-135m" in smol.overrides
    follow = load_plan(ROOT / "sweeps" / "smollm2_4bit.yaml", [])
    assert follow.grid and follow.n_trials == 9 and "train.steps=100" in follow.overrides  # the earlier 4-bit study
    sampler = load_plan(ROOT / "sweeps" / "smollm2_sampler.yaml", [])
    assert sampler.grid and sampler.n_trials == 9 and "model=smollm2-135m" in sampler.overrides


@pytest.mark.slow
def test_the_smollm2_study_specs_share_one_base():
    """The real-model study, its repeats, its learning-rate sweep and its wide-template rows:
    analysis pairs and groups runs only when every setting matches, so the specs' runs must differ
    in their configs alone."""
    study, repeat, lr, wide = (load_plan(ROOT / "sweeps" / f"smollm2_{name}.yaml", []) for name in ("study", "repeat", "lr", "wide"))
    assert study.grid and (study.n_trials, repeat.n_trials, lr.n_trials, wide.n_trials) == (20, 2, 8, 10)
    assert study.overrides == repeat.overrides == lr.overrides == wide.overrides
    assert all("task.templates=wide" in c and c[0] in (study.configs["full_precision"][0], study.configs["nvfp4_lora_paper"][0])
               for c in wide.configs.values())
    assert {"task=wordprob", "eval.at_start=true", "eval.every=50", "task.eval_size=100"} <= set(study.overrides)
    assert all(study.configs[name] == overrides for name, overrides in repeat.configs.items())
    assert study.configs["nvfp4_lora_relative"] == ["strategy=nvfp4_lora", "noise.relative=true"]
    assert {o.split("=")[1] for c in lr.configs.values() for o in c if o.startswith("train.lr=")} == {"2.5e-4", "1e-3", "2e-3"}


@pytest.mark.slow
def test_the_qwen_coder_check_and_pilot_make_one_four_way_grid():
    """The check's runs are the pilot's first two rows: analysis pairs runs only when every setting
    matches, so the two specs share one base and differ in their configs alone."""
    check, pilot = (load_plan(ROOT / "sweeps" / f"qwen_coder_{name}.yaml", []) for name in ("check", "pilot"))
    assert check.grid and pilot.grid and check.overrides == pilot.overrides and (check.n_trials, pilot.n_trials) == (8, 8)
    assert {"model=qwen2.5-coder-0.5b", "train.steps=60", "algo.max_new_tokens=192", "eval.at_start=true"} <= set(check.overrides)
    rows = {tuple(c) for plan in (check, pilot) for c in plan.configs.values()}
    assert rows == {(f"strategy={s}", f"train.lr={lr}") for s in ("full_precision", "nvfp4_lora_noaqn", "nvfp4_lora", "nf4_dq")
                    for lr in ("2e-4", "5e-4")}


def test_objective_reads_the_tail_or_the_area():
    rewards = [0.0, 1.0, 2.0, 3.0]
    assert Objective("reward", last=0.5).value(rewards, 4) == pytest.approx(2.5)
    assert Objective("reward", last=1.0).value(rewards, 4) == pytest.approx(1.5)
    assert Objective("reward", last_steps=1).value(rewards, 4) == pytest.approx(3.0)
    assert Objective("reward", last=0.25).value(rewards[:2], 4) == pytest.approx(1.0)  # running, step 1 of 4
    assert Objective("reward", reduce="auc").value(rewards, 4) == pytest.approx(1.5)
    assert Objective("reward", last=0.25).value([None, float("nan"), 1.0], 4) == pytest.approx(1.0)


def test_overrides_merge_and_format():
    assert merge_overrides(["noise=exp", "train.steps=60"], ["train.steps=6"], ["noise=cosine"]) == ["train.steps=6", "noise=cosine"]
    assert override("noise.sigma", 1e-05) == "noise.sigma=1e-05"
    assert override("quant.double_quant", True) == "quant.double_quant=true"
    assert override("lora.targets", ["q_proj", "v_proj"]) == "lora.targets=[q_proj,v_proj]"


@pytest.mark.parametrize("fields, argv, message", [
    ({"paramz": {}}, [], "unknown key 'paramz'"),
    ({"params": {"noise.sigmastart": {"type": "float", "low": 0.001, "high": 0.1}}}, [], "unknown parameter 'noise.sigmastart'"),
    ({"params": {"noise": {"type": "categorical", "choices": ["exp", "bogus"]}}}, [], "'bogus' is not a preset"),
    ({"params": {"noise.sigma": {"type": "float", "low": 0.1, "high": 0.01}}}, [], "params.noise.sigma"),
    ({"params": {"noise.sigma": {"type": "float", "low": -1.0, "high": 1.0}}}, [], "noise.sigma must be a finite number >= 0"),
    ({"params": {"noise.sigma": {"type": "gaussian"}}}, [], "type 'gaussian' is not one of"),
    ({"objective": {"metric": "reward", "last": 5}}, [], "count steps with last_steps"),
    ({"objective": {"metric": "rewrd"}}, [], "no run logs a metric named 'rewrd'; did you mean reward"),
    ({"objectives": [{"metric": "reward"}, {"metric": "perf/step_s", "direction": "minimize"}]}, [], "exactly one of objective"),
    ({"objective": None, "objectives": [{"metric": "reward"}, {"metric": "perf/step_s"}], "pruner": {"name": "median"}}, [], "prunes single-objective"),
    ({"sampler": {"name": "annealing"}}, [], "sampler 'annealing' is not known"),
    ({}, ["n_trials=many"], "n_trials='many' must be a whole number"),
    ({}, ["noise=exp,cosine"], "multirun syntax"),
    ({}, ["train.stepz=3"], "unknown config key 'train.stepz'"),
    ({}, ["storage=mongodb://x/y"], None),
])
def test_bad_specs_and_settings_end_in_one_usage_error(tmp_path, fields, argv, message):
    spec = write_spec(tmp_path, **fields)
    if fields.get("objective", "keep") is None:
        raw = yaml.safe_load(spec.read_text())
        raw.pop("objective")
        spec.write_text(yaml.safe_dump(raw))
    if message is None:  # storage URLs are checked when the storage opens
        from qerl_exp.sweep.study import open_storage

        with pytest.raises(UsageError, match="use sqlite:///PATH"):
            open_storage(load_plan(spec, argv))
        return
    with pytest.raises(UsageError) as info:
        load_plan(spec, argv)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_command_line_errors_are_one_line_without_traceback(tmp_path, capsys):
    from qerl_exp.sweep.__main__ import main

    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("base: [train.steps=2\nparams: {")
    # the command itself once (exit status, nothing else on stderr); the other cases through its `main`
    out = sweep(str(bad_yaml), timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr
    assert out.stderr.startswith("error: ") and "not valid YAML" in out.stderr, out.stderr
    cases = [
        ([str(write_spec(tmp_path, params={"noise.sigmastart": {"type": "float", "low": 0.001, "high": 0.1}}))],
         "unknown parameter 'noise.sigmastart'"),
        ([str(SPEC), "storage=postgresql://nobody@127.0.0.1:9/none"], "cannot open storage postgresql://nobody@127.0.0.1:9/none"),
        ([str(SPEC), f"sweep_dir={bad_yaml}"], f"cannot write {bad_yaml}: a file stands where a directory is needed; "
                                               "remove that file or choose another sweep_dir"),
    ]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # main installs its own
    try:
        for args, message in cases:
            with pytest.raises(SystemExit) as exit_:
                main(args)
            assert exit_.value.code == 2
            lines = capsys.readouterr().err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.mark.slow
@pytest.mark.parametrize("multi", [False, True])
def test_reports_of_a_finished_study(tmp_path, multi):
    """best_overrides (or the Pareto front), trials.csv and the plots, from a study made by hand."""
    from optuna.distributions import FloatDistribution

    from qerl_exp.sweep.report import summary_lines, write_reports
    from qerl_exp.sweep.study import open_storage, open_study

    objectives = {"objectives": [{"metric": "reward"}, {"metric": "perf/step_s", "direction": "minimize"}],
                  "pruner": {"name": "none"}} if multi else {}
    spec = write_spec(tmp_path, study_name="rep", base=["train.steps=2"], **objectives)
    if multi:
        raw = yaml.safe_load(spec.read_text())
        raw.pop("objective")
        spec.write_text(yaml.safe_dump(raw))
    plan = load_plan(spec, [f"sweep_dir={tmp_path / 's'}"])
    study = open_study(plan, open_storage(plan), create=True)
    dist = {"noise.sigma": FloatDistribution(1e-4, 1e-2, log=True)}
    for i, sigma in enumerate([1e-4, 1e-3, 1e-2, 3e-3]):
        values = [[1.0, 2.0], [2.0, 1.5], [3.0, 2.0], [0.5, 0.5]][i] if multi else [1.0 + i % 3]
        study.add_trial(optuna.create_trial(params={"noise.sigma": sigma}, distributions=dist, values=values,
                                            intermediate_values={0: 0.5, 1: values[0]},
                                            user_attrs={"overrides": ["train.steps=2", f"noise.sigma={sigma!r}"]}))
    paths = {p.relative_to(plan.sweep_dir).as_posix() for p in write_reports(plan, study)}
    assert "trials.csv" in paths
    rows = (plan.sweep_dir / "trials.csv").read_text().splitlines()
    assert len(rows) == 5 and rows[1].startswith("0,COMPLETE,1.0")
    if multi:
        assert {"pareto_front.yaml", "plots/pareto_front.png", "plots/param_importances_reward.png"} <= paths
        front = yaml.safe_load((plan.sweep_dir / "pareto_front.yaml").read_text())
        assert [e["trial"] for e in front] == [1, 2, 3] and front[0]["overrides"][-1] == "seed=0"
        assert (plan.sweep_dir / "pareto" / "trial0001.txt").read_text().split() == front[0]["overrides"]
    else:
        assert {"best_overrides.yaml", "best_overrides.txt", "plots/optimization_history.png",
                "plots/param_importances.png", "plots/parallel_coordinate.png", "plots/slice.png"} <= paths
        assert yaml.safe_load((plan.sweep_dir / "best_overrides.yaml").read_text()) == ["train.steps=2", "noise.sigma=0.01", "seed=0"]
        assert "best trial 2: reward = 3" in "\n".join(summary_lines(plan, study))


# ---------------------------------------------------------------------------------------------
# Whole sweeps (subprocesses, tiny runs)


@pytest.mark.slow
def test_interrupt_then_kill_then_resume_reaches_exactly_n_trials(tmp_path):
    """Ctrl-C after 2 trials, SIGKILL of the worker mid-trial after 4, rerun: 6 finished trials,
    none lost (each interrupted or killed trial is retried once, same parameters), none duplicated,
    and the sweep dir holds best overrides, trials.csv and plots."""
    sweep_dir = tmp_path / "sweep"
    # 10 steps a trial: long enough on a quiet machine for the test to catch a trial mid-run.
    args = [str(SPEC), "n_trials=6", "train.steps=10", f"sweep_dir={sweep_dir}", "heartbeat_interval=1",
            "grace_period=6", *TINY]
    db = sweep_dir / "study.db"

    # 1. Ctrl-C in the middle of the third trial.
    proc = subprocess.Popen(sweep_cmd(*args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=SUBPROCESS_ENV)
    victim = wait_for(lambda: running_mid_trial(db, "noise_schedule", 2), 600, "trial 3 to run", proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("error: interrupted with 2 of 6 trials finished"), err[-2000:]
    trials = load(db, "noise_schedule").get_trials()
    interrupted = trials[victim.number]
    assert interrupted.state == TrialState.FAIL and interrupted.user_attrs["interrupted"] is True
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == victim.number]
    assert len(retry) == 1 and retry[0].state == TrialState.WAITING and retry[0].params == interrupted.params

    # 2. Resume; SIGKILL the worker in the middle of a trial (its heartbeat stops), then the command.
    proc = subprocess.Popen(sweep_cmd(*args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=SUBPROCESS_ENV)
    killed = wait_for(lambda: running_mid_trial(db, "noise_schedule", 4), 600, "trial 5 to run", proc)
    os.kill(killed.user_attrs["worker_pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "killed by signal 9" in err.strip().splitlines()[-1], err[-2000:]
    assert load(db, "noise_schedule").get_trials()[killed.number].state == TrialState.RUNNING

    # 3. The same command again: the dead trial goes stale, fails, is retried; the study completes.
    out = sweep(*args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 failed and retried or replaced, 1 interrupted and resumed" in out.stdout + out.stderr, out.stdout[-2000:]
    trials = load(db, "noise_schedule").get_trials()
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(done) == 6 and len({t.number for t in done}) == 6
    assert {t.number for t in failed} == {victim.number, killed.number}
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    for f in failed:  # each retried exactly once, with its parameters, and finished
        retries = [t for t in trials if t.system_attrs.get("failed_trial") == f.number]
        assert len(retries) == 1 and retries[0] in done and retries[0].params == f.params
    for t in done:  # every finished trial is one ordinary run directory with its summary; a retry's is
        owner = t.system_attrs.get("failed_trial", t.number)  # the one of the trial it repeats
        run_dir = Path(t.user_attrs["run_dirs"][0])
        finished = "summary.json" if t.state == TrialState.COMPLETE else "metrics.jsonl"  # pruned: stopped early
        assert run_dir.name == f"trial{owner:04d}_s0" and (run_dir / finished).exists()
        config = json.loads((run_dir / "config.json").read_text())
        assert config["choices"]["study"] == "noise_schedule" and config["choices"]["trial"] == str(owner)
        assert config["seed"] == 0 and config["train"]["steps"] == 10
    # The Ctrl-C'd trial's run checkpointed its step; its retry continued that run rather than
    # starting over, and logged each step once.
    victim_dir = Path(interrupted.user_attrs["run_dirs"][0])
    logs = "".join(p.read_text() for p in (sweep_dir / "logs").glob("*.log"))
    assert f"resuming {victim_dir} at step " in logs, logs[-3000:]
    steps = [json.loads(line)["step"] for line in (victim_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(steps) == list(range(10)) and (victim_dir / "summary.json").exists()
    assert not list((sweep_dir / "trials").glob(f"trial{retry[0].number:04d}_s*"))

    # Reports: best overrides (ready to rerun), trials.csv, plots; a progress bar ran on stderr.
    best = yaml.safe_load((sweep_dir / "best_overrides.yaml").read_text())
    assert "quant=bf16" in best and "train.steps=10" in best and any(o.startswith("noise=") for o in best)
    assert (sweep_dir / "best_overrides.txt").read_text().split() == best
    rows = (sweep_dir / "trials.csv").read_text().splitlines()
    assert rows[0].startswith("number,state,value") and len(rows) == 1 + len(trials)
    for plot in ("optimization_history", "param_importances", "parallel_coordinate", "slice"):
        assert (sweep_dir / "plots" / f"{plot}.png").stat().st_size > 1000, plot
    assert "noise_schedule" in out.stderr and "trial/s" in out.stderr or "s/trial" in out.stderr
    assert f"rerun it: python -m qerl_exp $(cat {sweep_dir}/best_overrides.txt)" in out.stdout

    # The best overrides compose into a valid run config as they are.
    from qerl_exp.cli import validate

    validate(best, multirun=False)

    # A finished study: the same command only rewrites the reports.
    again = sweep(*args)
    assert again.returncode == 0 and "6 trials finished" in again.stdout
    assert len(load(db, "noise_schedule").get_trials()) == len(trials)


@pytest.mark.slow
def test_median_pruner_stops_a_trial_whose_reward_lags(tmp_path):
    """Trial 0 (no noise) learns; trial 1 (sigma = 10 on the norm scales: nothing but noise
    reaches the answer) earns zero reward, and the median pruner, fed by the run loop's on_step
    hook, stops it after its warm-up step."""
    spec = write_spec(
        tmp_path, study_name="prune", base=[*TINY, "noise=fixed", "train.steps=4"],
        params={"noise.sigma": {"type": "categorical", "choices": [0.0, 10.0]}},
        enqueue=[{"noise.sigma": 0.0}, {"noise.sigma": 10.0}],
        objective={"metric": "reward", "last": 1.0},
        pruner={"name": "median", "n_startup_trials": 1, "n_warmup_steps": 1}, n_trials=2)
    out = sweep(str(spec), f"sweep_dir={tmp_path / 'sweep'}")
    assert out.returncode == 0, out.stderr[-3000:]
    study = load(tmp_path / "sweep" / "study.db", "prune")
    first, lagging = study.get_trials()
    assert first.state == TrialState.COMPLETE and first.value > 0
    assert lagging.state == TrialState.PRUNED and lagging.params == {"noise.sigma": 10.0}
    assert lagging.user_attrs["pruned_at_step"] == 1 and sorted(lagging.intermediate_values) == [0, 1]
    assert max(lagging.intermediate_values.values()) < first.intermediate_values[1]
    run_dir = Path(lagging.user_attrs["run_dirs"][0])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["reward"] == 0 for r in rows)
    assert not (run_dir / "summary.json").exists()
    recorded = study.user_attrs["qerl_sweep"]["pruner"]
    assert recorded == {"name": "median", "n_startup_trials": 1, "n_warmup_steps": 1}
    assert "trial 1 pruned at step 1" in out.stderr
    assert "PRUNED" in (tmp_path / "sweep" / "trials.csv").read_text()


@pytest.mark.slow
def test_resuming_with_another_base_config_is_refused(tmp_path):
    from qerl_exp.sweep.study import open_storage, open_study

    spec = write_spec(tmp_path, study_name="ident", base=[*TINY, "train.steps=1"], n_trials=1)
    first = load_plan(spec, [f"sweep_dir={tmp_path / 's'}"])
    open_study(first, open_storage(first), create=True)
    neutral = load_plan(spec, [f"sweep_dir={tmp_path / 's'}", "tracker=offline", "n_trials=5"])  # tracking, count: free
    assert open_study(neutral, open_storage(neutral), create=True).user_attrs["qerl_sweep"]["n_trials"] == 5
    out = sweep(str(spec), f"sweep_dir={tmp_path / 's'}", "train.steps=2", timeout=120)
    assert out.returncode == 2 and "was made with other overrides" in out.stderr.strip().splitlines()[-1], out.stderr


# ---------------------------------------------------------------------------------------------
# Study integrity: one study per sweep dir, distinct workers, locked storage


@pytest.mark.slow
def test_a_sweep_dir_holds_the_trials_of_one_study(tmp_path):
    from qerl_exp.sweep.study import open_storage, open_study

    spec, sweep_dir = write_spec(tmp_path, study_name="a", base=[*TINY, "train.steps=1"], n_trials=1), tmp_path / "D"
    a = load_plan(spec, [f"sweep_dir={sweep_dir}"])
    storage = open_storage(a)
    open_study(a, storage, create=True)
    trial = sweep_dir / "trials" / "trial0000_s0"  # a's finished trial 0, as its worker left it
    trial.mkdir(parents=True)
    (trial / "config.json").write_text(json.dumps({"choices": {"study": "a", "trial": "0"}}))
    (trial / "metrics.jsonl").write_text('{"step": 0, "reward": 9.0}\n')
    (trial / "summary.json").write_text("{}")
    # b into a's sweep dir: refused before b exists, rather than completing its trial 0 with a's reward
    out = sweep(str(spec), "study_name=b", f"sweep_dir={sweep_dir}", timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"error: sweep_dir={sweep_dir} holds the trial runs of study 'a'; give study 'b' its own sweep_dir="]
    assert optuna.study.get_all_study_names(storage) == ["a"]

    from qerl_exp.sweep.study import check_sweep_dir, record_sweep_dir

    record_sweep_dir(a, optuna.load_study(study_name="a", storage=storage))  # what a's command records
    check_sweep_dir(a, storage)  # a itself goes on
    b = load_plan(spec, ["study_name=b", f"sweep_dir={sweep_dir}"])
    with pytest.raises(UsageError, match=f"sweep_dir={sweep_dir} holds the trials of study 'a' in sqlite:///{sweep_dir}/"
                                         "study.db, not of this 'b' in "):
        check_sweep_dir(b, storage)
    optuna.delete_study(study_name="a", storage=storage)  # a made again under its name and storage: another study
    open_study(a, storage, create=True)
    with pytest.raises(UsageError, match="holds the trials of study 'a' in"):
        check_sweep_dir(a, storage)


def test_workers_started_together_draw_distinct_parameters(tmp_path):
    from qerl_exp.sweep.spec import suggest
    from qerl_exp.sweep.study import open_storage, open_study, worker_study

    plan = load_plan(write_spec(tmp_path, sampler={"name": "random", "seed": 0}, n_trials=4), [f"sweep_dir={tmp_path / 's'}"])
    storage = open_storage(plan)
    open_study(plan, storage, create=True)
    first, second = worker_study(plan, storage), worker_study(plan, storage)  # both before either asks
    drawn = [suggest(plan, first.ask()), suggest(plan, second.ask())]
    assert drawn[0] != drawn[1]
    # the first worker of a new study draws with the spec's own seed: a one-worker study is reproducible
    assert suggest(plan, optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()) == drawn[0]


def _holds_open(pid: int, path: Path) -> bool:
    fds = Path(f"/proc/{pid}/fd")
    try:
        return any(os.readlink(fd) == str(path) for fd in fds.iterdir())
    except OSError:  # the process ended, or an fd closed while being read
        return False


@pytest.mark.slow
def test_a_locked_storage_is_one_line_within_seconds_and_signals_are_heeded(tmp_path, monkeypatch):
    import sqlite3

    from qerl_exp.sweep import storage as S
    from qerl_exp.sweep.study import open_study

    spec = write_spec(tmp_path)
    plan = load_plan(spec, [f"sweep_dir={tmp_path / 's'}"])
    open_study(plan, S.open_storage(plan), create=True)
    db = tmp_path / "s" / "study.db"
    holder = sqlite3.connect(db)
    holder.execute("BEGIN EXCLUSIVE")  # another program's open transaction (an sqlite3 shell, a DB browser)
    proc = subprocess.Popen(sweep_cmd(str(spec), f"sweep_dir={tmp_path / 's'}"), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=SUBPROCESS_ENV)
    try:
        wait_for(lambda: _holds_open(proc.pid, db), 120, "the sweep to wait on its storage", proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 130 and err.strip().splitlines() == ["error: interrupted"], err[-2000:]
        monkeypatch.setattr(S, "LOCKED_REPORT_S", 1.0)
        start = time.monotonic()
        with pytest.raises(UsageError) as info:
            S.open_storage(plan)
        assert time.monotonic() - start < 5
        assert str(info.value) == (f"storage {db} has been locked by another program for 1 s (an sqlite3 shell or a "
                                   "database browser with an open transaction?); close it and rerun")
    finally:
        proc.kill()
        holder.rollback()
        holder.close()


def test_a_claim_lock_held_by_a_stopped_worker_is_named_and_a_stop_ends_the_wait(tmp_path, monkeypatch, capsys):
    import fcntl

    from qerl_exp.sweep import storage as S
    from qerl_exp.sweep.study import open_study

    plan = load_plan(write_spec(tmp_path), [f"sweep_dir={tmp_path / 's'}"])
    open_study(plan, S.open_storage(plan), create=True)
    monkeypatch.setattr(S, "LOCKED_REPORT_S", 0.2)
    with open(f"{tmp_path / 's' / 'study.db'}.lock", "a+") as held:  # as a worker stopped inside its claim leaves it
        fcntl.flock(held, fcntl.LOCK_EX)
        held.truncate(0)
        held.write("4242")
        held.flush()
        end = time.monotonic() + 1.0
        with pytest.raises(KeyboardInterrupt):
            with S.claim_lock(plan, stop=lambda: time.monotonic() > end):  # a worker's SIGTERM at 1 s
                pass
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("waiting for the study's claim lock, held by process 4242"), err
    with S.claim_lock(plan):  # released: taken at once
        pass


@pytest.mark.slow
def test_the_gpu_study_specs_compose_and_the_pilot_seeds_stay_out_of_the_study():
    """The SmolLM2 take-off check (both learners, the earlier runs' settings), the learning-rate pilot
    and the confirmatory study: each trial's config composes, and the pilot's seeds are not the
    study's (the pilot chooses each row's rate)."""
    from qerl_exp.config.compose import compose

    check, pilot, confirm = (load_plan(ROOT / "sweeps" / f"smollm2_{name}.yaml", []) for name in ("check", "pilot", "confirm"))
    assert (check.n_trials, pilot.n_trials, confirm.n_trials) == (6, 24, 40)
    for plan in (check, pilot, confirm):
        for overrides in plan.configs.values():
            compose([*plan.overrides, *overrides])
    assert {c[0] for c in check.configs.values()} == {"train.padding_free=false", "train.padding_free=true"}
    seeds = {name: {c for p in plan.params if p.name == "seed" for c in p.distribution.choices}
             for name, plan in (("pilot", pilot), ("confirm", confirm))}
    assert not seeds["pilot"] & seeds["confirm"] and len(seeds["confirm"]) >= 10
