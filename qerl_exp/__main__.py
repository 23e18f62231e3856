"""`python -m qerl_exp [overrides]`: one run; `-m` for a Hydra multirun (one run dir and W&B run per job)."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from qerl_exp.cli import CONF_DIR, UsageError, fail, validate
from qerl_exp.config import GROUPS, from_dict, register_configs, to_config


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float:
    from qerl_exp.train import run

    hc = HydraConfig.get()
    run_dir = Path(cfg.resume or cfg.run_dir or hc.runtime.output_dir)
    choices = {g: str(hc.runtime.choices[g]) for g in (*GROUPS, "strategy") if hc.runtime.choices.get(g) is not None}
    multirun = hc.mode == RunMode.MULTIRUN
    group = Path(hc.sweep.dir).name if multirun else ""
    try:
        conf = to_config(cfg)
        if cfg.resume:  # continue with the config the run was started with
            saved = json.loads((run_dir / "config.json").read_text())
            conf, choices = from_dict(saved), saved.get("choices", {})
        summary = run(conf, run_dir, choices=choices, group=group)
    except Exception as e:  # noqa: BLE001 - reported in one line, the traceback kept on disk
        (run_dir / "error.txt").write_text(traceback.format_exc())
        message = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''} (traceback in {run_dir}/error.txt)"
        if multirun:  # let Hydra record the failure and go on with the sibling jobs
            print(f"error: job {hc.job.num} failed: {message}", file=sys.stderr)
            raise
        fail(message, code=1)
    print(f"run dir: {run_dir}  final reward: {summary['reward/final']:.3f} (mean of the last quarter of steps)")
    return summary["reward/final"]


def cli() -> None:
    register_configs()
    args = sys.argv[1:]
    multirun = "-m" in args or "--multirun" in args
    overrides = [a for a in args if not a.startswith("-")]
    if not any(a in args for a in ("--help", "-h", "--cfg", "-c", "--info", "--hydra-help")):
        try:
            validate(overrides, multirun)
        except UsageError as e:
            fail(str(e))
    main()


if __name__ == "__main__":
    cli()
