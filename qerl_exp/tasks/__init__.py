"""Tasks: where problems come from and how completions are scored.

A task yields `Problem`s (the prompt, the reference answer, the row's other columns, and for
synthetic tasks a worked solution used by the embedded model's warm-up) and holds the run's reward
functions (`reward_funcs`: the built-in ones or `task.reward_funcs`). `build_task(cfg)` is the one
entry point; adding a task is a new module plus one entry in `build_task`'s table.
"""

from __future__ import annotations

from typing import Callable

from qerl_exp.config.task import SYSTEM_PROMPT, TaskConfig
from qerl_exp.tasks import arith, datasets, fork, wordprob
from qerl_exp.tasks.base import Problem, Task, reference_completion
from qerl_exp.tasks.datasets import duplicates_line, file_digests
from qerl_exp.tasks.reward_funcs import source_files

__all__ = ["SYSTEM_PROMPT", "Problem", "Task", "build_task", "duplicates_line", "file_digests", "reference_completion",
           "source_files"]


def build_task(cfg: TaskConfig, seed: int = 0) -> Task:
    """The task named by `cfg.name`, with its reward functions loaded and checked against its rows;
    `seed` (the run's) orders the epoch sampler of a task that reads data.

    Raises:
        ValueError: one line: data that cannot be read, malformed rows, a reward function that
            does not import or cannot take the rows' columns (`reward_funcs.load`).
    """
    generated: dict[str, Callable[[TaskConfig], Task]] = {"arith": arith.ArithTask, "fork": fork.ForkTask,
                                                          "wordprob": wordprob.WordProblemTask}
    if cfg.name in generated:
        return generated[cfg.name](cfg)
    if cfg.name not in datasets.TASKS:
        raise ValueError(f"task.name={cfg.name!r} is not available; choose one of: "
                         f"{', '.join(sorted([*generated, *datasets.TASKS]))}")
    return datasets.TASKS[cfg.name](cfg, seed)
