"""Where metrics go: `metrics.jsonl` (always) and Weights & Biases (offline by default).

One JSON object per step in `metrics.jsonl` (`{"step": k, name: value, ...}`), a `summary.json`
at the end, and a W&B run whose files live inside the run directory. W&B gets the resolved config,
a group/job_type/tags built from the Hydra choices, and `step` as the x-axis of every chart.

`tracker.mode=online` checks first that the W&B host resolves (a few seconds at most): without
network the run logs offline at once, with one warning, instead of waiting out W&B's init timeout.
When W&B cannot start its offline run either (its folder cannot be written), the run logs to
`metrics.jsonl` alone, with one warning.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import warnings
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from urllib.parse import urlparse

from qerl_exp.config import TrackerConfig
from qerl_exp.files import write_atomic

RESOLVE_TIMEOUT_S = 3.0


def run_tags(choices: dict[str, str]) -> list[str]:
    """`group:choice` tags, e.g. `noise:adaptive`, `quant:nf4`."""
    return [f"{group}:{choice}" for group, choice in sorted(choices.items())]


def _unreachable(base_url: str) -> str | None:
    """Why the W&B host of `base_url` cannot be reached, or None when its name resolves."""
    host = urlparse(base_url).hostname or base_url
    pool = ThreadPoolExecutor(max_workers=1)
    try:  # getaddrinfo has no timeout of its own; a dead DNS server would block for long
        pool.submit(socket.getaddrinfo, host, 443).result(timeout=RESOLVE_TIMEOUT_S)
    except FutureTimeout:
        return f"resolving {host} took over {RESOLVE_TIMEOUT_S:g} s"
    except OSError as e:
        return f"cannot resolve {host}: {e.strerror or e}"
    finally:
        pool.shutdown(wait=False)
    return None


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
        mode = cfg.mode
        why = _unreachable(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")) if mode == "online" else None
        if why:
            warnings.warn(f"W&B is unreachable ({why}); logging offline instead (upload later with `wandb sync`)")
            mode = "offline"
        self.wandb = self._init(wandb, mode, kwargs)
        if self.wandb is None:
            return
        self.run_id = self.wandb.id
        self.wandb.define_metric("step")
        self.wandb.define_metric("*", step_metric="step")

    def _init(self, wandb, mode: str, kwargs: dict):
        """`wandb.init` in `mode`. A tracker fault must not end the run: a failing online init falls
        back to offline, a failing offline one (W&B cannot write its files) to `metrics.jsonl` alone."""
        before = set((self.run_dir / "wandb").glob("*"))
        try:
            return wandb.init(mode=mode, **kwargs)
        except Exception as e:  # noqa: BLE001 - W&B raises many types; the fallback is the same
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if mode != "online":
                warnings.warn(f"W&B cannot start its offline run in {self.run_dir / 'wandb'} ({why}); "
                              "logging to metrics.jsonl only")
                return None
            for half_made in set((self.run_dir / "wandb").glob("*")) - before:  # the failed online run's files
                if half_made.is_dir() and not half_made.is_symlink():
                    shutil.rmtree(half_made, ignore_errors=True)
                else:
                    half_made.unlink(missing_ok=True)
            warnings.warn(f"W&B online init failed ({why}); logging offline instead (upload later with `wandb sync`)")
            return self._init(wandb, "offline", kwargs)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        try:
            self.jsonl.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk: name the file (a resume drops the half-written line)
            raise OSError(e.errno, e.strerror, self.jsonl.name) from e
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
        write_atomic(self.run_dir / "summary.json", json.dumps({k: _jsonable(v) for k, v in summary.items()}, indent=2))
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
        try:
            self.jsonl.close()
        except OSError:  # the disk is full: the error being raised already says so
            pass


class NoTracker:
    """The tracker of a data-parallel run's other ranks: rank 0's `Tracker` logs for all of them,
    and these ranks write no file."""

    run_id = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def log_completions(self, step: int, rows: list[tuple[str, str, float]]) -> None:
        pass

    def finish(self, summary: dict) -> None:
        pass

    def abort(self) -> None:
        pass
