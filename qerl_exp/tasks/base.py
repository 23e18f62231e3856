"""What every task is made of: `Problem`, the reward function type, the `Task` protocol, its
evaluation splits (named in `qerl_exp.splits`), and a problem's reference completion. The task
modules import these from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from qerl_exp.splits import HELD_OUT, OOD, SPLITS  # noqa: F401 - the splits a task declares


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
    splits: tuple[str, ...]  # its evaluation splits, HELD_OUT first

    def sample(self, n: int, rng: np.random.Generator) -> list[Problem]:
        """`n` training problems drawn with `rng` (the run's data stream)."""
        ...

    def eval_problems(self, split: str = HELD_OUT) -> list[Problem]:
        """The problems of one of `splits`, the same on every call and for every seed."""
        ...


def check_split(task: Task, split: str) -> None:
    """Raise a one-line `ValueError` unless `split` is one of the task's evaluation splits."""
    if split not in task.splits:
        raise ValueError(f"split={split!r} is not a split of task {task.name}; choose one of: {', '.join(task.splits)}")
