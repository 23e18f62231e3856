"""Reward functions, each named and logged as `rewards/<name>/mean`.

The paper's rewards: 0.2 for the `<think>...</think><answer>...</answer>` format, 2.0 for an
exactly correct answer. Both amounts come from the task config.
"""

from __future__ import annotations

import re

from qerl_exp.tasks import Problem, RewardFn
from qerl_exp.tasks.answer import answers_equal

_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str) -> str | None:
    """The text inside the last `<answer>...</answer>`, or None."""
    found = _ANSWER.findall(completion)
    return found[-1].strip() if found else None


def format_reward(amount: float) -> RewardFn:
    def fmt(completion: str, problem: Problem) -> float:
        return amount if _FORMAT.match(completion) else 0.0

    return fmt


def correctness_reward(amount: float) -> RewardFn:
    def correct(completion: str, problem: Problem) -> float:
        answer = extract_answer(completion)
        return amount if answer is not None and answers_equal(answer, problem.answer) else 0.0

    return correct


def default_rewards(format_amount: float, correct_amount: float) -> dict[str, RewardFn]:
    return {"format": format_reward(format_amount), "correct": correctness_reward(correct_amount)}
