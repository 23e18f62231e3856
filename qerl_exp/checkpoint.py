"""Run state on disk: the LoRA adapter and everything needed to continue a run.

Writes are atomic (write into a temporary directory beside the target, then rename), so a killed
process leaves either the previous checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch


def rng_state(data_rng: np.random.Generator) -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "data": data_rng.bit_generator.state,
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save(path: Path, policy, state: dict) -> None:
    """Save the adapter (`adapter/`, peft format) and `state.pt` into `path`, atomically.

    Args:
        path: the checkpoint directory to (re)create.
        policy: the peft-wrapped policy.
        state: everything else (optimizer, schedulers, RNG, step, ...), saved with `torch.save`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    policy.save_pretrained(tmp / "adapter")
    torch.save(state, tmp / "state.pt")
    if path.exists():
        old = path.with_name(f".{path.name}-old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
