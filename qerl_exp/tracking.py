"""Where metrics go: `metrics.jsonl` (always) and Weights & Biases (offline by default).

One JSON object per step in `metrics.jsonl` (`{"step": k, name: value, ...}`), a `summary.json`
at the end, and a W&B run whose files live inside the run directory. W&B gets the resolved config,
a group/job_type/tags built from the Hydra choices, and `step` as the x-axis of every chart.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

from qerl_exp.config import TrackerConfig


def run_tags(choices: dict[str, str]) -> list[str]:
    """`group:choice` tags, e.g. `noise:adaptive`, `quant:nf4`."""
    return [f"{group}:{choice}" for group, choice in sorted(choices.items())]


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


class Tracker:
    """Logs per-step metrics to `metrics.jsonl` and, unless disabled, to W&B.

    Args:
        run_dir: the run directory; `metrics.jsonl`, `summary.json` and `wandb/` go there.
        cfg: the tracker config.
        config: the resolved run config (plain dicts) to record.
        name: the run's name.
        group: W&B group (e.g. the sweep or the multirun).
        job_type: W&B job type.
        tags: W&B tags.
        run_id: the W&B run id to continue (a resumed run); None starts a new W&B run.
    """

    def __init__(self, run_dir: Path, cfg: TrackerConfig, config: dict, name: str, group: str, job_type: str,
                 tags: list[str], run_id: str | None = None):
        self.run_dir = Path(run_dir)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.wandb = None
        self.run_id = run_id
        if cfg.mode == "disabled":
            return
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        kwargs = dict(dir=str(self.run_dir), project=cfg.project, entity=cfg.entity or None, name=name, group=group,
                      job_type=job_type, tags=tags, config=config, id=run_id, resume="allow" if run_id else None,
                      settings=wandb.Settings(console="off", x_disable_stats=True, init_timeout=60))
        try:
            self.wandb = wandb.init(mode=cfg.mode, **kwargs)
        except Exception as e:  # noqa: BLE001 - a tracker fault must not end the run
            if cfg.mode != "online":
                raise
            warnings.warn(f"W&B online init failed ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}); "
                          "logging offline instead (upload later with `wandb sync`)")
            self.wandb = wandb.init(mode="offline", **kwargs)
        self.run_id = self.wandb.id
        self.wandb.define_metric("step")
        self.wandb.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({"step": step, **metrics})

    def log_completions(self, step: int, rows: list[tuple[str, str, float]]) -> None:
        """A W&B table of (prompt, completion, reward) samples."""
        if self.wandb is None:
            return
        import wandb

        table = wandb.Table(columns=["step", "prompt", "completion", "reward"], data=[[step, *r] for r in rows])
        self.wandb.log({"step": step, "completions": table})

    def finish(self, summary: dict) -> None:
        (self.run_dir / "summary.json").write_text(json.dumps({k: _jsonable(v) for k, v in summary.items()}, indent=2))
        if self.wandb is not None:
            self.wandb.summary.update(summary)
            self.wandb.finish()
            self.wandb = None
        self.jsonl.close()

    def abort(self) -> None:
        """Close without a summary (the run failed); W&B marks the run failed."""
        if self.wandb is not None:
            self.wandb.finish(exit_code=1)
            self.wandb = None
        self.jsonl.close()
