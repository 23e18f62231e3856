"""Run state on disk: the LoRA adapter and everything needed to continue a run exactly.

Layout: `<run_dir>/checkpoints/step_000010/{adapter/, state.pt}` every `checkpoint.every` steps,
and `<run_dir>/final/` at the end. Writes are atomic (write into a hidden temporary directory
beside the target, then rename), so a killed process leaves whole checkpoints only. `latest`
returns the newest checkpoint that loads, falling back to an older one (and saying so) when the
newest is corrupt.

Each checkpoint records the number of CPU threads the run used: on CPU, float sums over another
thread count differ in the last bits (more so on some CPUs than others), so a run resumed with
another count no longer equals an uninterrupted one. `latest` says so when they differ.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from qerl_exp.run.files import as_os_error, temp_dir


ADAPTER_FILE = "adapter_model.safetensors"  # what peft's save_pretrained writes


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed the run's global RNGs (Python's, numpy's, torch's) and, with `deterministic`, ask torch
    for deterministic algorithms (a warning where it has none)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def rng_state(data_rng: np.random.Generator) -> dict:
    """Every RNG a step draws from: python, numpy, torch (and CUDA), and the data stream."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "data": data_rng.bit_generator.state,
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict, data_rng: np.random.Generator) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    data_rng.bit_generator.state = state["data"]
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(path: Path, policy, state: dict) -> None:
    """Save the adapter (`adapter/`, peft format) and `state.pt` into `path`, atomically.

    Args:
        path: the checkpoint directory to (re)create.
        policy: the peft-wrapped policy.
        state: everything else (optimizer, schedulers, RNG, step, ...), saved with `torch.save`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(path.parent, prefix=f".{path.name}-")
    try:
        policy.save_pretrained(tmp / "adapter")
        with open(tmp / "state.pt", "wb") as f:  # a Python file: a full disk raises OSError, not a zip-writer error
            torch.save({**state, "threads": torch.get_num_threads()}, f)
    except BaseException as e:  # leave no partial checkpoint behind, and name the checkpoint
        shutil.rmtree(tmp, ignore_errors=True)
        cause = as_os_error(e)
        if cause is not None:
            raise OSError(cause.errno, cause.strerror, str(path)) from e
        raise
    if path.exists():
        old = path.with_name(f".{path.name}-old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the `keep` newest checkpoints (and leftovers of interrupted writes)."""
    root = Path(run_dir) / "checkpoints"
    for leftover in root.glob(".step_*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest(run_dir: Path, logged: int | None = None) -> tuple[Path, dict] | None:
    """The newest checkpoint of `run_dir` that loads, with its state; None when there is none.

    Args:
        run_dir: the run directory.
        logged: how many steps, from step 0, `metrics.jsonl` holds; a checkpoint past them is passed
            over with a warning (resuming there would leave the steps in between unlogged for good).
            None: every checkpoint counts.

    A checkpoint that fails to load is reported with a warning and the next older one is tried.
    """
    ahead = []
    for path in sorted((Path(run_dir) / "checkpoints").glob("step_*"), reverse=True):
        if logged is not None and _step(path) > logged:
            ahead.append(path.name)
            continue
        try:
            state = torch.load(path / "state.pt", weights_only=False)
            if not (path / "adapter" / ADAPTER_FILE).exists():
                raise FileNotFoundError(f"{ADAPTER_FILE} missing")
            threads = state.get("threads")
            if threads is not None and threads != torch.get_num_threads():
                warnings.warn(f"{path} was written by a run with {threads} CPU thread(s), resumed with "
                              f"{torch.get_num_threads()}: later steps may differ in the last bits from an "
                              f"uninterrupted run (set OMP_NUM_THREADS={threads} to match)")
            break
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back to an older one
            warnings.warn(f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); trying an older one")
    else:
        path = None
    if ahead:
        held = f"steps 0-{logged - 1} only" if logged else "no step"
        warnings.warn(f"{Path(run_dir) / 'metrics.jsonl'} holds {held}, so the run continues "
                      f"{f'from {path.name}' if path else 'from step 0'} and not from {', '.join(reversed(ahead))} "
                      "(their steps' metrics are missing: they are run again)")
    return (path, state) if path is not None else None


def _step(path: Path) -> int:
    """The step a checkpoint directory (`step_000010`) resumes at; -1 for a name that holds none."""
    digits = path.name.removeprefix("step_")
    return int(digits) if digits.isdigit() else -1


def adapter_file(adapter_dir: str | Path) -> Path:
    """The adapter file of `adapter_dir`; FileNotFoundError (one line) when the run saved none."""
    path = Path(adapter_dir) / ADAPTER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: the run saved no trained adapter (did it finish?)")
    return path


def load_adapter(policy, adapter_dir: str | Path) -> int:
    """Load a saved LoRA adapter (peft format) into `policy`'s active adapter, in place.

    Args:
        policy: a peft-wrapped model with the same LoRA layout (targets, rank) as the saved one.
        adapter_dir: a directory written by `save_pretrained`, e.g. `RUN/final/adapter`.

    Returns:
        The number of tensors loaded.

    Raises:
        FileNotFoundError: no adapter file in `adapter_dir`.
        ValueError: the file is not readable safetensors (e.g. truncated), or it lacks some of the policy's LoRA weights, has others, or shapes differ.
    """
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = adapter_file(adapter_dir)
    try:
        saved = load_file(str(path), device=str(next(policy.parameters()).device))
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file ({str(e).splitlines()[0]}): truncated or "
                         "overwritten; use an intact copy or rerun the training") from None
    expected = get_peft_model_state_dict(policy)
    missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    shapes = [key for key in set(expected) & set(saved) if expected[key].shape != saved[key].shape]
    if missing or extra or shapes:
        raise ValueError(
            f"{path} does not match the rebuilt policy's LoRA: {len(missing)} missing (e.g. {missing[:1]}), "
            f"{len(extra)} unexpected (e.g. {extra[:1]}), {len(shapes)} of another shape (e.g. {shapes[:1]})"
        )
    set_peft_model_state_dict(policy, saved)
    return len(saved)
