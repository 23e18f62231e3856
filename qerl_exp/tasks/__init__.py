"""Tasks: where problems come from and how completions are scored.

A task yields `Problem`s (question, reference answer, and for synthetic tasks a worked solution
used by the embedded model's warm-up) and names its reward functions. `build_task(cfg)` is the
one entry point; adding a task is a new module plus one line in `_TASKS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from qerl_exp.config import SYSTEM_PROMPT, TaskConfig

__all__ = ["SYSTEM_PROMPT", "Problem", "RewardFn", "Task", "build_task", "reference_completion"]


@dataclass(frozen=True)
class Problem:
    """One problem: the question shown to the model and the reference answer."""

    question: str
    answer: str
    solution: str = ""


RewardFn = Callable[[str, Problem], float]


def reference_completion(problem: Problem) -> str:
    """The problem's worked solution and answer in the paper's format: what the embedded model's
    warm-up imitates and what evaluation's `eval/solution_logp` scores."""
    return f"<think>{problem.solution}</think><answer>{problem.answer}</answer>"


class Task(Protocol):
    name: str
    rewards: dict[str, RewardFn]

    def sample(self, n: int, rng: np.random.Generator) -> list[Problem]:
        """`n` training problems drawn with `rng` (the run's data stream)."""
        ...

    def eval_problems(self) -> list[Problem]:
        """The held-out problems, the same on every call."""
        ...


def build_task(cfg: TaskConfig) -> Task:
    """The task named by `cfg.name`."""
    from qerl_exp.tasks import arith, wordprob

    tasks: dict[str, Callable[[TaskConfig], Task]] = {"arith": arith.ArithTask, "wordprob": wordprob.WordProblemTask}
    try:
        from qerl_exp.tasks import datasets as _datasets

        tasks.update(_datasets.TASKS)
    except ImportError:
        pass
    if cfg.name not in tasks:
        raise ValueError(f"task.name={cfg.name!r} is not available; choose one of: {', '.join(sorted(tasks))}")
    return tasks[cfg.name](cfg)
