"""`task=arith`: synthetic integer arithmetic, seeded and unlimited.

Questions look like `37+45=`; the reference completion the warm-up learns from is
`<think>37+45=82</think><answer>82</answer>`.
"""

from __future__ import annotations

import numpy as np

from qerl_exp.config.task import TaskConfig
from qerl_exp.tasks import reward_funcs
from qerl_exp.tasks.base import HELD_OUT, Problem, check_split

_EVAL_SEED = 1_000_003  # fixed, and far from any training seed's stream


class ArithTask:
    name = "arith"
    splits = (HELD_OUT,)
    columns = ("answer",)

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        self.rewards = reward_funcs.load(cfg, self.columns)

    def sample(self, n: int, rng: np.random.Generator, start: int | None = None) -> list[Problem]:
        # new problems at every draw: no epochs (`start` is for tasks over a fixed list)
        hi = 10 ** self.cfg.difficulty
        a, b = rng.integers(0, hi, size=n), rng.integers(0, hi, size=n)
        ops = rng.choice(len(self.cfg.ops), size=n)
        return [self._problem(int(x), int(y), self.cfg.ops[o]) for x, y, o in zip(a, b, ops)]

    def eval_problems(self, split: str = HELD_OUT) -> list[Problem]:
        check_split(self, split)
        return self.sample(self.cfg.eval_size, np.random.default_rng(_EVAL_SEED))

    @staticmethod
    def _problem(a: int, b: int, op: str) -> Problem:
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = f"{a}{op}{b}="
        return Problem(question=question, answer=str(value), solution=f"{question}{value}")
