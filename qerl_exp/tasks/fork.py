"""`task=fork`: a strategy-discovery task, where finding the better route needs exploration.

Every problem is an arithmetic question (`37+45=`, as `task=arith` draws them) that a reply can
solve by either of two routes, announced by its first token: `A` (the plain route) or `B` (the
marked route), then the answer, then EOS:

    37+45=  ->  A82   (route A: correct_reward / 2 when right)
            ->  B82   (route B: correct_reward when right)

plus `task.format_reward` for any reply of that shape. Both routes compute the same answer; they
differ only in what a right answer earns. The embedded model's warm-up teaches both routes to
competence and sets the base policy's probability of opening with `B` to `task.route_b_prior`
(`rl.routes`). GRPO's advantages sum to zero within a group, so a group that never samples `B`
gives the route token no push toward it: the policy can move to `B` only after sampling it, which
is what a higher-entropy sampler (quantization error, AQN, a higher temperature) may do sooner.

What a run logs from this task (names in `qerl_exp.rl.metrics`): `fork/b_share`, the share of the
step's completions on route B; `fork/route_entropy`, the sampler's entropy at the route token (the
first completion token); evaluation adds `fork/b_share` of the greedy replies under its prefix
(`eval/fork/b_share`). Its built-in `format` and `correct` (`builtin`) are reward functions in TRL's
batched signature like any other; `task.reward_funcs` may name others.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from typing import Callable

from qerl_exp.config.task import TaskConfig
from qerl_exp.tasks import reward_funcs
from qerl_exp.tasks.arith import ArithTask
from qerl_exp.tasks.base import Problem
from qerl_exp.tasks.rewards import completion_text

ROUTES = ("A", "B")
_REPLY = re.compile(r"^([AB])(-?\d+)$")


def reply(problem: Problem, route: str) -> str:
    """The reply that solves `problem` by `route` (`A` or `B`): what the warm-up teaches."""
    return f"{route}{problem.answer}"


def route(completion: str) -> str | None:
    """The route a reply announces (`A` or `B`), or None for a reply of another shape."""
    m = _REPLY.match(completion.strip())
    return m.group(1) if m else None


def is_correct(completion: str, answer: str) -> bool:
    """Whether a reply has the route-and-answer shape and the exact answer."""
    m = _REPLY.match(completion.strip())
    return m is not None and int(m.group(2)) == int(answer)


def format_reward(amount: float) -> Callable[..., list[float]]:
    """`format`: `amount` for each reply of the shape `<route><answer>`, right or wrong."""
    def format_(prompts, completions, **columns) -> list[float]:
        return [amount if route(completion_text(c)) is not None else 0.0 for c in completions]

    return format_


def route_reward(amount: float) -> Callable[..., list[float]]:
    """`correct`: a right answer earns `amount` on route B and half of it on route A; a wrong one 0."""
    def correct(prompts, completions, answer, **columns) -> list[float]:
        texts = [completion_text(c) for c in completions]
        return [(amount if route(t) == "B" else amount / 2) if is_correct(t, a) else 0.0 for t, a in zip(texts, answer)]

    return correct


def builtin(name: str, cfg: TaskConfig) -> Callable[..., list[float]]:
    """The task's built-in reward function `name` (`format` or `correct`) with its amounts."""
    return format_reward(cfg.format_reward) if name == "format" else route_reward(cfg.correct_reward)


def b_share(texts: list[str]) -> float:
    """The share of `texts` that take route B (nan for none)."""
    return sum(route(t) == "B" for t in texts) / len(texts) if texts else math.nan


class ForkTask(ArithTask):
    """Two routes to every answer of `task=arith`'s questions (see the module docstring); the
    problems, training draws and held-out split are arith's."""

    name = "fork"
    routes = ROUTES

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        self.rewards = reward_funcs.load(cfg, self.columns, builtins=builtin)

    @staticmethod
    def _problem(a: int, b: int, op: str) -> Problem:
        # the base route's reply is the problem's reference completion (eval/solution_logp scores it)
        problem = ArithTask._problem(a, b, op)
        return dataclasses.replace(problem, solution="", completion=reply(problem, "A"))

    def step_metrics(self, texts: list[str], route_entropy: list[float]) -> dict[str, float]:
        """A step's route metrics: the share of completions on route B, and the mean entropy of the
        sampler at the route token (`route_entropy`, one per completion)."""
        return {"fork/b_share": b_share(texts), "fork/route_entropy": float(np.mean(route_entropy))}

    def eval_metrics(self, greedy: list[str], prefix: str) -> dict[str, float]:
        """The greedy replies' route: the share of problems answered on route B."""
        return {f"{prefix}fork/b_share": b_share(greedy)}
