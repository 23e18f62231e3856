"""A study's storage and the worker loop that runs its trials.

Every worker, on this machine or another, runs `work()` against the same storage:

0. Seed its sampler with the spec's seed plus the count of workers the study started before it
   (`worker_study`), so that workers started together never draw the same parameters.
1. Under a claim lock (a file lock for SQLite, an advisory lock for PostgreSQL), fail trials whose
   heartbeat stopped (a killed worker; Optuna then re-enqueues them with the same parameters),
   count the trials and ask for one only while `complete + pruned + running < n_trials`.
   So the whole study, not each worker, stops at exactly `n_trials` finished trials.
2. Run the trial: one ordinary run directory and W&B run per seed (group = the study name),
   reporting the objective after every step so that the pruner can stop it.
3. Tell the result. Ctrl-C or SIGTERM marks the running trial FAIL and re-enqueues it at once (a
   heartbeat would do the same, later), so re-running the command loses and repeats nothing.

A sweep dir holds the trials of one study (`check_sweep_dir`, `record_sweep_dir`). The storage,
its URL and the claim lock are `qerl_exp.sweep.storage`'s.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from qerl_exp.config.compose import compose
from qerl_exp.run.console import UsageError
from qerl_exp.run.signals import StopSignals
from qerl_exp.sweep.spec import (Plan, grid_points, load_plan, host, make_pruner, make_sampler, override_key, suggest,
                                 trial_overrides, trial_seeds)
from qerl_exp.sweep.storage import claim_lock, first_line, open_storage, quiet_optuna, shown

ATTR = "qerl_sweep"  # the study user attribute that records the spec, pruner and sampler
WORKERS = "qerl_sweep:workers"  # the study system attribute counting the workers ever started
OWNER_FILE = "study.json"  # in the sweep dir: the one study whose trials it holds
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
# Overrides that do not change results; a study may be resumed with them changed.
_NEUTRAL = ("tracker", "model.cache_dir", "hydra")


# ---------------------------------------------------------------------------------------------
# The study


def open_study(plan: Plan, storage: RDBStorage, *, create: bool, seed_offset: int = 0) -> optuna.Study:
    """Create (or load) the plan's study; on first creation record the spec and enqueue its trials.

    Raises:
        UsageError: the study exists but was made from another spec, objective or base config.
    """
    sampler, pruner = make_sampler(plan, seed_offset), make_pruner(plan)
    try:
        if not create:
            return optuna.load_study(study_name=plan.study_name, storage=storage, sampler=sampler, pruner=pruner)
        study = optuna.create_study(storage=storage, study_name=plan.study_name, directions=plan.directions,
                                    sampler=sampler, pruner=pruner, load_if_exists=True)
    except KeyError:
        raise UsageError(f"no study '{plan.study_name}' in {shown(plan.storage)}") from None
    if [d.name.lower() for d in study.directions] != plan.directions:
        raise UsageError(f"study '{plan.study_name}' in {shown(plan.storage)} optimizes {[d.name.lower() for d in study.directions]}, "
                         f"the spec {plan.directions}; use another study_name=")
    identity = _identity(plan)
    with claim_lock(plan):
        if study.metric_names is None:  # dashboards then label the objectives by metric, not "Objective 0"
            study.set_metric_names([o.metric for o in plan.objectives])
        recorded = study.user_attrs.get(ATTR)
        if recorded is None:
            study.set_user_attr(ATTR, {"identity": identity, "spec": json.loads(json.dumps(plan.spec, default=str)),
                                       "spec_path": str(plan.spec_path), "sampler": plan.sampler,
                                       "pruner": plan.pruner, "n_trials": plan.n_trials, "token": uuid.uuid4().hex})
            for params in plan.enqueue:
                study.enqueue_trial(params, skip_if_exists=True)
        else:
            for key, value in identity.items():
                if recorded["identity"].get(key) != value:
                    raise UsageError(f"study '{plan.study_name}' in {shown(plan.storage)} was made with other {key} "
                                     f"({_short(recorded['identity'].get(key))} vs {_short(value)}); resume it with the same "
                                     f"spec and overrides, or start another with study_name=NAME")
            # the token: a study made before studies had one gets it now
            updated = {"n_trials": plan.n_trials, "token": recorded.get("token") or uuid.uuid4().hex}
            if any(recorded.get(k) != v for k, v in updated.items()):
                study.set_user_attr(ATTR, {**recorded, **updated})
    return study


def check_sweep_dir(plan: Plan, storage: RDBStorage | None = None) -> None:
    """Refuse a sweep dir that holds another study's trials, before the study is created or run
    (trial N of every study would otherwise find `trials/trialNNNN_sS` of the first and read it).

    The first study to use a sweep dir records itself in `SWEEP_DIR/study.json` (`record_sweep_dir`):
    its name, storage and the token made when the study was created, so that a study made again
    under the same name and storage is another study too. Without `storage`, only what the record
    tells without opening one is checked (a study of another name or storage is refused before
    anything of the owner's is touched, its storage's lock file included).

    Raises:
        UsageError: the sweep dir belongs to another study, or (made before the record existed)
            holds trial runs of one.
    """
    path = plan.sweep_dir / OWNER_FILE
    if path.is_file() and storage is None:
        owner = _owner(plan, path)
        if (owner.get("study_name"), owner.get("storage")) != (plan.study_name, shown(plan.storage)):
            _check_owner(plan, path, None)
        return
    if path.is_file():
        try:
            token = storage.get_study_user_attrs(storage.get_study_id_from_name(plan.study_name)).get(ATTR, {}).get("token")
        except KeyError:  # not created yet
            token = None
        _check_owner(plan, path, token)
        return
    others = sorted({_study_of(c) for c in (plan.sweep_dir / "trials").glob("*/config.json")} - {plan.study_name, None})
    if others:
        raise UsageError(f"sweep_dir={plan.sweep_dir} holds the trial runs of study '{others[0]}'; "
                         f"give study '{plan.study_name}' its own sweep_dir=")


def record_sweep_dir(plan: Plan, study: optuna.Study) -> None:
    """Record `study` as the sweep dir's owner, unless one is recorded (see `check_sweep_dir`).

    Raises:
        UsageError: another study, started at the same time, recorded itself first.
    """
    token = study.user_attrs[ATTR]["token"]
    path = plan.sweep_dir / OWNER_FILE
    if not path.is_file():
        plan.sweep_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=plan.sweep_dir, prefix=f".{OWNER_FILE}-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"study_name": plan.study_name, "storage": shown(plan.storage), "token": token}, f, indent=2)
            os.link(tmp, path)  # whole and exclusive: of two studies started together, one records itself
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    _check_owner(plan, path, token)


def _owner(plan: Plan, path: Path) -> dict:
    try:
        owner = json.loads(path.read_text())
        if not isinstance(owner, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} is unreadable ({type(e).__name__}); it names the study whose trials this sweep_dir "
                         "holds: restore it, or give this study another sweep_dir=") from None
    return owner


def _check_owner(plan: Plan, path: Path, token: str | None) -> None:
    owner = _owner(plan, path)
    if owner.get("token") != token:
        raise UsageError(f"sweep_dir={plan.sweep_dir} holds the trials of study '{owner.get('study_name')}' in "
                         f"{owner.get('storage')}, not of this '{plan.study_name}' in {shown(plan.storage)}; "
                         "give this study its own sweep_dir=")


def _study_of(config_path: Path) -> str | None:
    """The study a trial's run directory was made by (its recorded `choices.study`)."""
    try:
        return json.loads(config_path.read_text()).get("choices", {}).get("study")
    except (OSError, ValueError, AttributeError):
        return None


def worker_study(plan: Plan, storage: RDBStorage) -> optuna.Study:
    """The study as one worker samples it: the spec's sampler seed plus a number that no other
    worker of the study drew (a counter in the storage, taken under the claim lock), so that workers
    started together, by one command or several, draw distinct parameters, and the first worker of
    a new study draws exactly the spec's seed."""
    study_id = storage.get_study_id_from_name(plan.study_name)
    with claim_lock(plan):
        started = storage.get_study_system_attrs(study_id).get(WORKERS, 0)
        storage.set_study_system_attr(study_id, WORKERS, started + 1)
    return open_study(plan, storage, create=False, seed_offset=started)


def _identity(plan: Plan) -> dict:
    ident = plan.identity()
    ident["overrides"] = [o for o in ident["overrides"] if not override_key(o).startswith(_NEUTRAL)]
    return json.loads(json.dumps(ident))


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) < 120 else text[:117] + "..."


def counts(trials: list[FrozenTrial]) -> dict[TrialState, int]:
    """Trials per state (every state present, 0 where none)."""
    out = {s: 0 for s in TrialState}
    for t in trials:
        out[t.state] += 1
    return out


def was_interrupted(trial: FrozenTrial) -> bool:
    """A failed trial that was interrupted (Ctrl-C, a time limit's SIGINT), not broken: its retry
    resumes its run, so summaries count it apart from failures."""
    return trial.state == TrialState.FAIL and trial.user_attrs.get("interrupted") is True


def finished(c: dict[TrialState, int]) -> int:
    return c[TrialState.COMPLETE] + c[TrialState.PRUNED]


# ---------------------------------------------------------------------------------------------
# Heartbeats


class Heartbeat:
    """Records a trial's heartbeat every `interval` seconds from a thread, until `stop()`."""

    def __init__(self, storage: RDBStorage, trial_id: int, interval: int):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(storage, trial_id, interval), daemon=True)
        self._thread.start()

    def _beat(self, storage, trial_id, interval) -> None:
        while not self._stop.wait(interval):
            try:
                storage.record_heartbeat(trial_id)
            except Exception:  # noqa: BLE001 - a missed beat is retried; the trial decides
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _trial_id(trial: optuna.Trial) -> int:
    return trial._trial_id  # the storage key; Optuna exposes only the per-study number


# ---------------------------------------------------------------------------------------------
# Trials


class _Reporter:
    """The `on_step` hook: checks the objective metrics exist, reports the running objective and
    raises `TrialPruned` when the pruner says so."""

    def __init__(self, plan: Plan, trial: optuna.Trial, seed_index: int, done: list[list[float]], steps: int,
                 signals: StopSignals):
        self.plan, self.trial, self.seed_index, self.done, self.steps, self.signals = plan, trial, seed_index, done, steps, signals
        self.series: list[float] = []

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        missing = [o.metric for o in self.plan.objectives if o.metric not in metrics]
        if missing:
            raise UsageError(f"objective metric '{missing[0]}' is not logged; logged names: {', '.join(sorted(metrics))}")
        if len(self.plan.objectives) > 1:
            return  # Optuna prunes single-objective studies only
        obj = self.plan.objectives[0]
        self.series.append(metrics[obj.metric])
        running = obj.value(self.series, self.steps)
        if not math.isfinite(running):
            return
        # Seeds run one after another; the intermediate value averages the finished seeds with this one.
        value = (sum(d[0] for d in self.done) + running) / (len(self.done) + 1)
        at = self.seed_index * self.steps + step
        with self.signals.deferred():
            self.trial.report(value, at)
            prune = self.trial.should_prune()
            if prune:
                self.trial.set_user_attr("pruned_at_step", at)
        if prune:
            raise optuna.TrialPruned(f"pruned at step {at}: {obj.metric} {value:.4g}")


def _objective_values(plan: Plan, run_dir: Path, steps: int) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [o.value([r.get(o.metric) for r in rows if isinstance(r.get(o.metric), (int, float))], steps)
            for o in plan.objectives]


def _run_dir(plan: Plan, trial_number: int, seed: int) -> Path:
    return plan.sweep_dir / "trials" / f"trial{trial_number:04d}_s{seed}"


def _check_trial_dir(plan: Plan, run_dir: Path) -> None:
    """Refuse a trial's run dir that holds a run another study made (a sweep dir reused by another
    study, however it passed `check_sweep_dir`): the trial would take that run, finished or not, as
    its own. Nothing in it is changed.

    Raises:
        UsageError: one line naming the run, its study and what to do.
    """
    config = run_dir / "config.json"
    if config.is_file() and _study_of(config) != plan.study_name:
        raise UsageError(f"{run_dir} holds a run of study {_study_of(config)!r}, not of this study '{plan.study_name}': "
                         f"sweep_dir={plan.sweep_dir} holds another study's trials; give study '{plan.study_name}' its "
                         "own sweep_dir=")


def run_trial(plan: Plan, study: optuna.Study, storage: RDBStorage, trial: optuna.Trial, signals: StopSignals,
              log=print) -> TrialState:
    """Run one trial (one run per seed) and tell the study how it ended.

    Returns:
        The trial's final state. Raises KeyboardInterrupt after recording an interrupted trial
        (FAIL, re-enqueued), and UsageError for a spec fault no trial can survive.
    """
    from qerl_exp.train import run  # torch and the models: only trial processes need them, not the coordinator

    heartbeat = Heartbeat(storage, _trial_id(trial), plan.heartbeat_interval)
    t0 = time.time()
    run_dirs: list[str] = []
    try:
        values, overrides, seeds, owner = _start(plan, storage, trial, signals)
        shown_values = " ".join(f"{k}={_fmt(v)}" for k, v in values.items())
        log(f"trial {trial.number} started: {shown_values}")
        per_seed = _run_seeds(plan, trial, values, overrides, seeds, owner, signals, run_dirs, run)
        result = [sum(v[j] for v in per_seed) / len(per_seed) for j in range(len(plan.objectives))]
        heartbeat.stop()
        return _tell(plan, study, trial, result, signals, log, t0)
    except optuna.TrialPruned as e:
        heartbeat.stop()
        with signals.deferred():
            study.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)
        log(f"trial {trial.number} {e}")
        return TrialState.PRUNED
    except KeyboardInterrupt:
        heartbeat.stop()
        _interrupted(plan, study, trial, log)
        raise
    except Exception as e:  # noqa: BLE001 - the trial fails; the study goes on
        heartbeat.stop()
        _failed(study, trial, e, run_dirs, signals, log)
        if isinstance(e, UsageError):
            raise
        return TrialState.FAIL
    finally:
        heartbeat.stop()


def _start(plan: Plan, storage: RDBStorage, trial: optuna.Trial, signals: StopSignals):
    """The trial's parameters, overrides and seeds, recorded on it (a signal waits until they are),
    and the trial whose runs it continues (its own, or for a retry the trial it repeats)."""
    with signals.deferred():
        values = suggest(plan, trial)
        overrides = trial_overrides(plan, values)
        if trial.user_attrs.get("interrupted"):  # a retry inherits the attributes of the trial it repeats
            trial.set_user_attr("interrupted", False)
        trial.set_user_attr("overrides", overrides)
        trial.set_user_attr("worker", f"{host()}:{os.getpid()}")
        trial.set_user_attr("worker_pid", os.getpid())
        seeds = trial_seeds(plan, values)
        # A retry (of an interrupted or dead trial) continues the runs of the trial it repeats, from
        # their last checkpoints: GPU hours already spent are not spent again.
        owner = storage.get_trial(_trial_id(trial)).system_attrs.get("failed_trial", trial.number)
        trial.set_user_attr("run_dirs", [str(_run_dir(plan, owner, s)) for s in seeds])
    return values, overrides, seeds, owner


def _run_seeds(plan: Plan, trial: optuna.Trial, values: dict, overrides: list[str], seeds: list[int], owner: int,
               signals: StopSignals, run_dirs: list[str], run) -> list[list[float]]:
    """One run per seed (a run that finished before the trial was cut is kept), each run directory
    added to `run_dirs` before anything is written there; each run's objective values."""
    per_seed: list[list[float]] = []
    with signals.interruptible():
        for i, seed in enumerate(seeds):
            run_dir = _run_dir(plan, owner, seed)
            _check_trial_dir(plan, run_dir)  # before anything is written there
            run_dirs.append(str(run_dir))
            cfg, choices = compose(overrides + [f"seed={seed}", f"run_dir={run_dir}"])
            choices.update({"study": plan.study_name, "trial": str(owner)})
            choices.update({k: _fmt(v) for k, v in values.items() if k not in choices})
            reporter = _Reporter(plan, trial, i, per_seed, cfg.train.steps, signals)
            if not (run_dir / "summary.json").exists():  # finished before the trial was cut: kept
                # the run's steps heed a first signal gracefully: it checkpoints the step it is in
                run(cfg, run_dir, choices=choices, group=plan.study_name, on_step=reporter, stop=signals)
            per_seed.append(_objective_values(plan, run_dir, cfg.train.steps))
    return per_seed


def _tell(plan: Plan, study: optuna.Study, trial: optuna.Trial, result: list[float], signals: StopSignals, log,
          t0: float) -> TrialState:
    """Tell the study the trial's objective values (a non-finite one fails it); its final state."""
    if not all(math.isfinite(v) for v in result):
        with signals.deferred():
            trial.set_user_attr("error", f"objective is not finite: {result}")
            study.tell(trial, state=TrialState.FAIL)
        log(f"trial {trial.number} failed: objective is not finite ({result})")
        return TrialState.FAIL
    with signals.deferred():
        told = study.tell(trial, result, skip_if_finished=True)
    if told.state != TrialState.COMPLETE:
        log(f"trial {trial.number} finished, but another worker had declared it dead (missed heartbeats: "
            f"raise grace_period); its retry runs it again")
        return told.state
    log(f"trial {trial.number} complete in {time.time() - t0:.0f} s: "
        + ", ".join(f"{o.metric}={v:.4g}" for o, v in zip(plan.objectives, result)))
    return TrialState.COMPLETE


def _interrupted(plan: Plan, study: optuna.Study, trial: optuna.Trial, log) -> None:
    """An interrupted trial: marked FAIL and re-enqueued with the same parameters (unless another
    worker already failed and retried it)."""
    _ignore_signals()
    frozen = study.get_trials(deepcopy=False)[trial.number]
    if not frozen.state.is_finished():  # else another worker already failed and retried it
        trial.set_user_attr("interrupted", True)
        frozen = study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        # The same retry a heartbeat timeout would make, without the wait.
        RetryHeartbeatStaleTrialCallback(max_retry=plan.max_retry)(study, frozen)
    log(f"trial {trial.number} interrupted: marked FAIL and re-enqueued with the same parameters")


def _failed(study: optuna.Study, trial: optuna.Trial, e: Exception, run_dirs: list[str], signals: StopSignals,
            log) -> None:
    """A failed trial: its error recorded on it (the traceback in its last run's directory), FAIL."""
    message = f"{type(e).__name__}: {first_line(e)}"
    if run_dirs and Path(run_dirs[-1]).is_dir():
        (Path(run_dirs[-1]) / "error.txt").write_text(traceback.format_exc())
        message += f" (traceback in {run_dirs[-1]}/error.txt)"
    with signals.deferred():
        if not study.get_trials(deepcopy=False)[trial.number].state.is_finished():
            trial.set_user_attr("error", message)
        study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
    log(f"trial {trial.number} failed: {message}")


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _ignore_signals() -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)


def _enqueue_grid_point(plan: Plan, study: optuna.Study) -> None:
    """Queue the next grid point: the first that no trial has tried, else the first whose trials all failed.

    Optuna's GridSampler alone cannot drive this loop: it counts a failed point as visited (never
    rerun), and on the last point it calls `Study.stop()`, which raises outside `Study.optimize`.
    So every grid trial is enqueued with its point (GridSampler then only records the space) and a
    failed point comes back here, after the untried ones so that it cannot hold up the rest;
    retries of interrupted trials keep their point.
    """
    tried, taken = [], []
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.WAITING:
            return  # ask() takes it
        point = t.system_attrs.get("fixed_params") or t.params  # a running trial has no params until it suggests them
        tried.append(point)
        if t.state != TrialState.FAIL:
            taken.append(point)
    points = grid_points(plan.params)
    for point in [p for p in points if p not in tried] + [p for p in points if p not in taken]:
        study.enqueue_trial(point)
        return


def work(plan: Plan, log=print) -> int:
    """The worker loop: claim trials and run them until the study has `n_trials` finished ones.

    Args:
        plan: the sweep.
        log: where progress lines go.

    Returns:
        An exit status: 0 the study is complete, 130 interrupted, 1 too many failures in a row,
        2 a spec fault (e.g. an objective metric that is never logged).
    """
    signals = StopSignals(take_all=True)
    quiet_optuna()
    try:
        with signals.interruptible():  # a locked storage is waited for, a signal is not
            storage = open_storage(plan)
            open_study(plan, storage, create=False)  # a missing study in one line
            study = worker_study(plan, storage)
    except UsageError as e:
        log(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        return 130
    failures = 0
    poll = min(2.0, plan.heartbeat_interval)
    while not signals.stop:
        try:
            with claim_lock(plan, stop=lambda: signals.stop):
                optuna.storages.fail_stale_trials(study)
                c = counts(study.get_trials(deepcopy=False))
                if finished(c) >= plan.n_trials:
                    log(f"study complete: {finished(c)} of {plan.n_trials} trials finished")
                    return 0
                trial = None
                if finished(c) + c[TrialState.RUNNING] < plan.n_trials:
                    if plan.grid:
                        _enqueue_grid_point(plan, study)
                    trial = study.ask()
                    storage.record_heartbeat(_trial_id(trial))
        except KeyboardInterrupt:  # stopped while waiting for the claim lock
            return 130
        if trial is None:  # the rest are running elsewhere; wait in case one of them dies
            signals.sleep(poll)
            continue
        try:
            state = run_trial(plan, study, storage, trial, signals, log=log)
        except KeyboardInterrupt:
            return 130
        except UsageError as e:
            log(f"error: {e}")
            return 2
        failures = failures + 1 if state == TrialState.FAIL else 0
        if failures >= plan.max_failures:
            log(f"error: {failures} trials in a row failed (see the trials' error.txt); stopping this worker")
            return 1
    return 130


def worker_main(index: int, spec_path: str, argv: list[str]) -> int:
    """Entry of a worker process started by the sweep command."""
    try:
        plan = load_plan(Path(spec_path), argv, check_config=False)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    def log(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)

    log(f"worker {index} started: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")
    return work(plan, log=log)
