"""What every task is made of: `Problem`, the reward function type, the `Task` protocol, its
evaluation splits, and a problem's reference completion. The task modules import these from here,
so that the package (`qerl_exp.tasks`) can import the task modules at its top."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np


@dataclass(frozen=True)
class Problem:
    """One problem: the question shown to the model and the reference answer; `source` names where
    a file-backed one was read (`FILE line N`), for messages about it."""

    question: str
    answer: str
    solution: str = ""
    source: str = field(default="", compare=False)


RewardFn = Callable[[str, Problem], float]

# Evaluation splits: every task holds problems out of training (`heldout`, phrased as training's
# are); a task whose problems come from templates may also have an out-of-template split (`ood`).
HELD_OUT, OOD = "heldout", "ood"
SPLITS = (HELD_OUT, OOD)


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
