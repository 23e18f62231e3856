"""The conditional search space of `noise_schedule.yaml`.

`suggest(trial)` returns `{override key: value}`; the sweep validates every key against the Hydra
config and records the values in the trial. Optuna parameter names equal the override keys, except
`sigma_end_ratio`, from which `noise.sigma_end = noise.sigma_start * sigma_end_ratio` derives (a
decay then never ends above where it starts).
"""

DECAYS = ["exp", "linear", "cosine", "log"]


def suggest(trial) -> dict:
    schedule = trial.suggest_categorical("noise", ["none", "fixed", *DECAYS])
    if schedule == "none":
        return {"noise": schedule}
    if schedule == "fixed":
        return {"noise": schedule, "noise.sigma": trial.suggest_float("noise.sigma", 1e-4, 5e-2, log=True)}
    sigma_start = trial.suggest_float("noise.sigma_start", 1e-3, 1e-1, log=True)
    ratio = trial.suggest_float("sigma_end_ratio", 1e-3, 1.0, log=True)
    return {
        "noise": schedule,
        "noise.sigma_start": sigma_start,
        "noise.sigma_end": sigma_start * ratio,
        "noise.num_stages": trial.suggest_int("noise.num_stages", 3, 12),
        "noise.denominator": trial.suggest_categorical("noise.denominator", ["paper", "code"]),
    }
