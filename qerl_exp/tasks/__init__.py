"""Tasks: where problems come from and how completions are scored.

A task yields `Problem`s (question, reference answer, and for synthetic tasks a worked solution
used by the embedded model's warm-up) and names its reward functions. `build_task(cfg)` is the
one entry point; adding a task is a new module plus one entry in `build_task`'s table.
"""

from __future__ import annotations

from typing import Callable

from qerl_exp.config import SYSTEM_PROMPT, TaskConfig
from qerl_exp.tasks import arith, datasets, fork, wordprob
from qerl_exp.tasks.base import Problem, RewardFn, Task, reference_completion
from qerl_exp.tasks.datasets import file_digests

__all__ = ["SYSTEM_PROMPT", "Problem", "RewardFn", "Task", "build_task", "file_digests", "reference_completion"]


def build_task(cfg: TaskConfig) -> Task:
    """The task named by `cfg.name`."""
    tasks: dict[str, Callable[[TaskConfig], Task]] = {"arith": arith.ArithTask, "fork": fork.ForkTask,
                                                      "wordprob": wordprob.WordProblemTask,
                                                      **datasets.TASKS}
    if cfg.name not in tasks:
        raise ValueError(f"task.name={cfg.name!r} is not available; choose one of: {', '.join(sorted(tasks))}")
    return tasks[cfg.name](cfg)
