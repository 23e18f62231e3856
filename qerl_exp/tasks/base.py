"""What every task is made of: `Problem`, the reward function type, the `Task` protocol, and a
problem's reference completion. The task modules import these from here, so that the package
(`qerl_exp.tasks`) can import the task modules at its top."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np


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
