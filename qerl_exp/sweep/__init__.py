"""Optuna sweeps over noise schedules (and anything else in the config), driven directly.

The PyPI Hydra Optuna sweeper pins optuna<3, so the sweep drives Optuna 5 itself while keeping
Hydra's feel: a spec in `sweeps/*.yaml` names the base overrides, the search space, the
objective(s), the sampler and the pruner, and the command line adds settings and overrides::

    python -m qerl_exp.sweep sweeps/noise_schedule.yaml n_trials=6 train.steps=6

Each trial is an ordinary run directory (`SWEEP_DIR/trials/trialNNNN_sS`; a retry of an interrupted
or dead trial continues that trial's) and W&B run, grouped under the study name; workers on one machine (`n_jobs`) or many (`storage=postgresql://...`) share
one study. Modules: `spec` (the YAML and its validation), `storage` (URL, opening, claim lock),
`study` (the study, its sweep dir, the worker loop), `report` (best overrides, trials.csv, plots).
See docs/sweeps.md.

Example:

    .. code-block:: python

        from pathlib import Path
        from qerl_exp.sweep import load_plan, main

        plan = load_plan(Path("sweeps/noise_schedule.yaml"), ["n_trials=6", "train.steps=6"])
        print(plan.study_name, plan.n_trials, plan.storage)
        main(["sweeps/noise_schedule.yaml", "n_trials=6", "train.steps=6"])  # the command itself
"""

from qerl_exp.sweep.spec import Objective, Param, Plan, load_plan

__all__ = ["Objective", "Param", "Plan", "load_plan", "main"]


def main(argv: list[str] | None = None) -> int:
    """Run the sweep command with `argv` (`[SPEC, key=value, ...]`); returns its exit status."""
    # Imported on call: at the package's top, `python -m qerl_exp.sweep` would import the command
    # module twice (as qerl_exp.sweep.__main__ and as __main__).
    from qerl_exp.sweep.__main__ import main as _main

    return _main(argv)
