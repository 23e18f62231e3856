"""What a finished study's report tells: a one-line warning when every trial ties, and plots that
stay readable with many parameters."""

from __future__ import annotations

import matplotlib.image
import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from qerl_exp.sweep.report import summary_lines, write_reports
from qerl_exp.sweep.spec import load_plan
from qerl_exp.sweep.study import open_storage, open_study

SPACE = {
    "noise.sigma_start": FloatDistribution(1e-3, 5e-2, log=True),
    "noise.sigma_end": FloatDistribution(1e-5, 1e-3, log=True),
    "noise.num_stages": IntDistribution(2, 12),
    "noise.denominator": CategoricalDistribution(["paper", "code"]),
    "noise": CategoricalDistribution(["exp", "linear", "cosine", "log", "fixed"]),
    "train.lr": FloatDistribution(1e-4, 1e-2, log=True),
    "lora.r": IntDistribution(4, 64, log=True),
    "algo.eps_high": FloatDistribution(0.2, 0.4),
}


def _study(tmp_path, values: list[float]):
    tmp_path.mkdir(exist_ok=True)
    spec = tmp_path / "many.yaml"
    spec.write_text("base: [train.steps=2]\nparams:\n  noise.sigma: {type: float, low: 1.0e-4, high: 1.0e-2}\n"
                    "objective: {metric: reward}\nn_trials: 12\n")
    plan = load_plan(spec, [f"sweep_dir={tmp_path / 's'}"], check_config=False)
    study = open_study(plan, open_storage(plan), create=True)
    sampler = optuna.samplers.RandomSampler(seed=0)
    draw = optuna.create_study(sampler=sampler)
    for v in values:
        trial = draw.ask(SPACE)
        study.add_trial(optuna.create_trial(params=trial.params, distributions=SPACE, values=[v],
                                            user_attrs={"overrides": ["train.steps=2"]}))
    return plan, study


def test_all_trials_tie_gives_one_warning_line(tmp_path):
    plan, study = _study(tmp_path, [0.684375] * 6)
    write_reports(plan, study)
    warnings = [line for line in summary_lines(plan, study) if line.startswith("warning:")]
    assert warnings == ["warning: all 6 complete trials tie (reward = 0.6844): nothing to learn at this budget; "
                        "raise train.steps or the task's difficulty, or widen the space"]
    # A study that learned something says nothing of the kind.
    plan, study = _study(tmp_path / "b", [0.684375] * 5 + [0.66875])
    assert not [line for line in summary_lines(plan, study) if line.startswith("warning:")]


def test_plots_stay_readable_with_many_parameters(tmp_path):
    plan, study = _study(tmp_path, [0.1 * (i % 5) for i in range(12)])
    paths = {p.name: p for p in write_reports(plan, study)}
    # The slice plot is a grid, three panels a row (one row of 8 panels was 3.8 times wider than high).
    height, width = matplotlib.image.imread(paths["slice.png"]).shape[:2]
    assert 0.8 < width / height < 2.0, (width, height)
    # Parallel coordinates widen with the parameter count (Optuna's default is 6.4 inches for any:
    # 640 pixels here, its axes' labels on top of each other).
    height, width = matplotlib.image.imread(paths["parallel_coordinate.png"]).shape[:2]
    assert width >= 100 * (len(SPACE) + 1), (width, height)
