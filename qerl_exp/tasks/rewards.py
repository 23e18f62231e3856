r"""Reward functions, each named and logged as `rewards/<name>/mean`.

The paper's rewards: 0.2 for the `<think>...</think><answer>...</answer>` format, 2.0 for an
exactly correct answer. Both amounts come from the task config; a format reward of 0 is left out.

Where the judged answer comes from is `task.answer_from`: `tags` reads only the last
`<answer>...</answer>` (the paper); `text` also reads an instruct model's natural forms when a
reply has no tags, in this order: the last `\boxed{...}`, the number after the last `####`, the
number after the last "answer is", else the reply's last number (as GSM8K's strict and flexible
extractions do).
"""

from __future__ import annotations

import re

from qerl_exp.config import TaskConfig
from qerl_exp.tasks.base import Problem, RewardFn
from qerl_exp.tasks.answer import answers_equal, last_boxed

_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A number as replies write it: sign, currency, thousands separators, decimals (`-$1,250.50`).
_NUMBER = r"-?\$?\s?\d+(?:,\d{3})*(?:\.\d+)?"
_MARKED = re.compile(rf"(?:####|answer is)\s*:?\s*(?:\*\*)?\s*({_NUMBER})", re.IGNORECASE)


def extract_answer(completion: str) -> str | None:
    """The text inside the last `<answer>...</answer>`, or None."""
    found = _ANSWER.findall(completion)
    return found[-1].strip() if found else None


def natural_answer(completion: str) -> str | None:
    r"""The answer of a reply in any of the forms instruct models write.

    Args:
        completion: the model's reply.

    Returns:
        The last `<answer>` tag's content, else the last `\boxed{}`'s, else the number after the
        last `####` or "answer is", else the last number in the reply; None when it has no number.

    Example:
        >>> natural_answer("5 + 7 = 12 apples. The answer is 12."), natural_answer("so \\boxed{7}")
        ('12', '7')
        >>> natural_answer("She has 3 left, then buys 4: 7 apples")
        '7'
    """
    tagged = extract_answer(completion)
    if tagged is not None:
        return tagged
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    marked = _MARKED.findall(completion)
    if marked:
        return marked[-1].strip()
    numbers = re.findall(_NUMBER, completion)
    return numbers[-1].strip() if numbers else None


def format_reward(amount: float) -> RewardFn:
    def fmt(completion: str, problem: Problem) -> float:
        return amount if _FORMAT.match(completion) else 0.0

    return fmt


def correctness_reward(amount: float, answer_from: str = "tags") -> RewardFn:
    extract = natural_answer if answer_from == "text" else extract_answer

    def correct(completion: str, problem: Problem) -> float:
        answer = extract(completion)
        return amount if answer is not None and answers_equal(answer, problem.answer) else 0.0

    return correct


def default_rewards(cfg: TaskConfig) -> dict[str, RewardFn]:
    """The task's rewards: `correct` (judged per `cfg.answer_from`) and `format` unless its amount is 0."""
    rewards = {"correct": correctness_reward(cfg.correct_reward, cfg.answer_from)}
    if cfg.format_reward:
        rewards = {"format": format_reward(cfg.format_reward), **rewards}
    return rewards
