"""Shared test helpers: tests never reach W&B servers, and runs are kept tiny."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["WANDB_MODE"] = "disabled"
ROOT = Path(__file__).resolve().parent.parent

# A run small enough for CI: 2 prompts x 4 completions per step, tracker off.
TINY_RUN = ["tracker.mode=disabled", "train.prompts_per_step=2", "algo.group_size=4"]
# Every subprocess a test starts runs with these settings. One thread: OpenMP threads of concurrent
# runs spin against each other on 2 cores, and float sums over 1 and 2 threads differ in the last
# bits on some CPUs, so runs compared bit for bit must use the same count.
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def qerl(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m qerl_exp ARGS` from the repository root and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "qerl_exp", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        env={**SUBPROCESS_ENV, **(env or {})},
    )


@pytest.fixture(scope="session")
def tiny_policy():
    """The embedded model (warmed up once, cached) as a bf16-config policy with LoRA, on CPU."""
    import torch

    from qerl_exp.cli import compose_config
    from qerl_exp.config import to_config
    from qerl_exp.model import build_models
    from qerl_exp.tasks import build_task

    cfg = to_config(compose_config(["monitor.every=1"]))
    task = build_task(cfg.task)
    return cfg, task, build_models(cfg, task, torch.device("cpu"))
