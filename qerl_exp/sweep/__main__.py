"""`python -m qerl_exp.sweep SPEC.yaml [key=value ...]`: run or resume an Optuna study.

The command validates the spec, creates or loads the study, starts `n_jobs` worker processes
(logs in `SWEEP_DIR/logs/`), shows a progress bar of the whole study, and at the end writes the
best overrides, `trials.csv` and the plots. Ctrl-C stops the workers, whose running trials are
marked failed and re-enqueued; running the same command again resumes the study.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from qerl_exp.cli import parse_command_line
from qerl_exp.run.console import UsageError, fail, tolerate_closed_pipes
from qerl_exp.run.files import check_writable, os_error_line
from qerl_exp.run.record import run_holding
from qerl_exp.run.rundir import other_runs
from qerl_exp.sweep import dashboard
from qerl_exp.sweep.report import summary_lines, write_reports
from qerl_exp.sweep.spec import SETTINGS, host, load_plan
from qerl_exp.sweep.storage import open_storage, quiet_optuna
from qerl_exp.sweep.study import check_sweep_dir, counts, finished, open_study, record_sweep_dir, was_interrupted, worker_main

USAGE = f"""usage: python -m qerl_exp.sweep SPEC.yaml [key=value ...]
       python -m qerl_exp.sweep dashboard SPEC.yaml [storage=URL] [port=8080] [host=127.0.0.1]

Runs (or resumes) the Optuna study that SPEC.yaml defines. Each key=value is a sweep setting if the
key is one of {', '.join(SETTINGS)}; anything else is a Hydra override given to every trial
(e.g. train.steps=30). --config-dir DIR adds a folder of your own presets, as for a run. Examples:

  python -m qerl_exp.sweep sweeps/noise_schedule.yaml n_trials=6 train.steps=6
  python -m qerl_exp.sweep sweeps/noise_schedule.yaml n_jobs=2 storage=postgresql://user@db:5432/optuna

Results go to sweeps/runs/STUDY_NAME/ (sweep_dir=...): trials/, trials.csv, plots/,
best_overrides.yaml and best_overrides.txt (rerun: python -m qerl_exp $(cat .../best_overrides.txt)).
`dashboard` serves optuna-dashboard on the study, live while it runs. See docs/sweeps.md."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    tolerate_closed_pipes()
    if argv[:1] == ["--worker"]:
        return worker_main(int(argv[1]), argv[2], argv[3:])
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    # Ctrl-C and kill both stop the study cleanly, even when started where SIGINT is ignored
    # (a background job of a script).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_interrupt)
    quiet_optuna()
    if argv[0] == "dashboard":
        return dashboard.main(argv[1:])
    spec_path, rest = argv[0], argv[1:]
    try:
        rest = own_presets(rest)  # the workers get the search-path override it becomes
        plan = load_plan(Path(spec_path), rest)
        try:
            check_writable(plan.sweep_dir)
        except OSError as e:
            raise UsageError(os_error_line(e, "sweep_dir")) from None
        _check_own_folder(plan.sweep_dir)
        check_sweep_dir(plan)  # another study's sweep dir: refused before its storage is opened
        storage = open_storage(plan)
        check_sweep_dir(plan, storage)
        study = open_study(plan, storage, create=True)
        record_sweep_dir(plan, study)
    except UsageError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted", code=130)

    if finished(counts(study.get_trials(deepcopy=False))) < plan.n_trials:
        code = _run_workers(plan, study, spec_path, rest)
        if code:
            return code
    write_reports(plan, study)
    for line in summary_lines(plan, study):
        print(line)
    return 0


def own_presets(argv: list[str]) -> list[str]:
    """`argv` with `--config-dir DIR` (`-cd DIR`, `--config-dir=DIR`) as the `hydra.searchpath`
    override it amounts to (`cli.parse_command_line`); any other option is refused."""
    overrides, args = parse_command_line(argv)
    flags = {k: v for k, v in vars(args).items() if k not in ("overrides", "config_dir") and v not in (None, False)}
    if flags:
        raise UsageError(f"the sweep command takes key=value items and --config-dir DIR, not --{next(iter(flags)).replace('_', '-')}")
    return overrides


def _check_own_folder(sweep_dir: Path) -> None:
    """Refuse a sweep dir in a run directory, or holding runs other than its trials: their files
    would mix (`python -m analysis` would read the trials as parts of that run, or those runs as trials)."""
    run = run_holding(sweep_dir)
    held = other_runs(sweep_dir, skip=("trials",))
    if run is not None or held is not None:
        raise UsageError(f"sweep_dir={sweep_dir} {f'is in the run directory {run}' if run else f'holds other runs (e.g. {held})'}; "
                         "give the sweep a folder of its own")


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _die_with_parent() -> None:
    """In a worker: get SIGTERM when the sweep command dies (even by SIGKILL), as Ctrl-C would."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: workers outlive a killed command, heartbeats cover it
        pass


def _run_workers(plan, study, spec_path: str, rest: list[str]) -> int:
    from optuna.trial import TrialState
    from tqdm import tqdm

    logs = plan.sweep_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    tag = f"{host()}-{os.getpid()}"
    gpus = visible_gpus(os.environ)
    workers = []
    for i in range(plan.n_jobs):
        env = worker_env(os.environ, i, gpus)
        log = logs / f"{tag}-w{i}.log"
        with open(log, "ab") as f:  # the child keeps its own handle
            # A session of their own: a terminal's Ctrl-C reaches the command, which stops each
            # worker exactly once.
            p = subprocess.Popen([sys.executable, "-m", "qerl_exp.sweep", "--worker", str(i), spec_path, *rest],
                                 stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                 start_new_session=True, preexec_fn=_die_with_parent)
        workers.append((i, p, log))

    trials = study.get_trials(deepcopy=False)
    c = counts(trials)
    tty = sys.stderr.isatty()
    bar = tqdm(total=plan.n_trials, initial=min(finished(c), plan.n_trials), desc=plan.study_name, unit="trial",
               dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
    seen = {t.number for t in trials if t.state.is_finished()}
    gone: set[int] = set()
    shown: tuple = ()
    stopped = False
    try:
        while True:
            alive = [w for w in workers if w[1].poll() is None]
            trials = study.get_trials(deepcopy=False)
            for t in trials:
                if t.state.is_finished() and t.number not in seen:
                    seen.add(t.number)
                    if was_interrupted(t):
                        bar.write(f"trial {t.number} interrupted: its retry resumes its run", file=sys.stderr)
                    elif t.state == TrialState.FAIL:
                        reason = t.user_attrs.get("error") or "its worker stopped (no heartbeat)"
                        bar.write(f"trial {t.number} failed: {reason}", file=sys.stderr)
                    elif t.state == TrialState.PRUNED:
                        bar.write(f"trial {t.number} pruned at step {t.user_attrs.get('pruned_at_step')}", file=sys.stderr)
            c, resumed = counts(trials), sum(map(was_interrupted, trials))
            status = (f"running={c[TrialState.RUNNING]} pruned={c[TrialState.PRUNED]} "
                      f"failed={c[TrialState.FAIL] - resumed}{f' resumed={resumed}' if resumed else ''}"
                      f"{_best_text(plan, study, c)}")
            if (finished(c), status) != shown or tty:  # in a log, a line per change only
                bar.n = min(finished(c), plan.n_trials)
                bar.set_postfix_str(status, refresh=False)
                bar.refresh()
                shown = (finished(c), status)
            for i, p, log in workers:
                if i not in gone and p.poll() is not None:
                    gone.add(i)
                    if p.returncode != 0 and alive:
                        bar.write(f"worker {i} stopped: {_why(p, log)}", file=sys.stderr)
            if not alive:
                break
            time.sleep(1.0)
    except KeyboardInterrupt:
        stopped = True
        _stop(workers, bar)
    finally:
        bar.close()
    c = counts(study.get_trials(deepcopy=False))
    if stopped:
        fail(f"interrupted with {finished(c)} of {plan.n_trials} trials finished; running trials were marked failed "
             f"and re-enqueued: rerun the same command to resume", code=130)
    if finished(c) >= plan.n_trials:
        return 0
    reasons = [f"worker {i}: {_why(p, log)}" for i, p, log in workers if p.returncode != 0] or ["workers exited early"]
    fail(f"study incomplete ({finished(c)} of {plan.n_trials} trials): {reasons[0]}", code=1)
    return 1


def visible_gpus(environ: dict[str, str]) -> list[str]:
    """The GPUs this command may use: the entries of `CUDA_VISIBLE_DEVICES` when set, else every CUDA device."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    import torch  # slow to import, and needed only when CUDA_VISIBLE_DEVICES is unset

    return [str(i) for i in range(torch.cuda.device_count())]


def worker_env(environ: dict[str, str], index: int, gpus: list[str]) -> dict[str, str]:
    """The environment worker `index` starts with: pinned to one GPU, round-robin, when several are visible.

    Args:
        environ: the command's environment.
        index: the worker's index among the command's `n_jobs`.
        gpus: the visible GPUs (`visible_gpus`).

    Returns:
        A copy of `environ` with unbuffered output and, with two or more GPUs, `CUDA_VISIBLE_DEVICES`
        set to `gpus[index % len(gpus)]`; with none or one it is left as it was.
    """
    env = {**environ, "PYTHONUNBUFFERED": "1"}
    if len(gpus) > 1:
        env["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
    return env


def _best_text(plan, study, c) -> str:
    from optuna.trial import TrialState

    if len(plan.objectives) != 1 or not c[TrialState.COMPLETE]:
        return ""
    try:
        return f" best={study.best_value:.4g}"
    except ValueError:
        return ""


def _stop(workers, bar) -> None:
    """Ctrl-C: each worker marks its trial FAIL, re-enqueues it and exits; a second Ctrl-C kills them."""
    alive = [w for w in workers if w[1].poll() is None]
    bar.write(f"interrupted: stopping {len(alive)} worker(s); their running trials are marked failed and re-enqueued",
              file=sys.stderr)
    for _, p, _ in alive:
        p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 120
    try:
        for _, p, _ in alive:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        bar.write("killing the workers; their trials fail when their heartbeats stop, and are retried", file=sys.stderr)
        for _, p, _ in alive:
            if p.poll() is None:
                p.kill()
        for _, p, _ in alive:
            p.wait()


def _why(p: subprocess.Popen, log: Path) -> str:
    if p.returncode is not None and p.returncode < 0:
        return f"killed by signal {-p.returncode} (log: {log})"
    lines = [line for line in log.read_text(errors="replace").splitlines() if "error:" in line]
    if lines:
        return lines[-1].split("error:", 1)[1].strip() + f" (log: {log})"
    return f"exited with status {p.returncode} (log: {log})"


if __name__ == "__main__":
    sys.exit(main())
