r"""The built-in reward functions, `format` and `correct`, in TRL's batched signature
`fn(prompts, completions, **columns) -> list[float]` (`qerl_exp.tasks.reward_funcs` calls them as it
calls a user's).

The paper's rewards: 0.2 for the `<think>...</think><answer>...</answer>` format, 2.0 for an
exactly correct answer. Both amounts come from the task config; a format reward of 0 leaves
`format` out of the default functions.

Where the judged answer comes from is `task.answer_from`: `tags` reads only the last
`<answer>...</answer>` (the paper); `text` also reads an instruct model's natural forms when a
reply has no tags, in this order: the last `\boxed{...}`, the number after the last `####`, the
number after the last "answer is", else the reply's last number (as GSM8K's strict and flexible
extractions do).
"""

from __future__ import annotations

import re
from typing import Callable

from qerl_exp.config.task import TaskConfig
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


def completion_text(completion) -> str:
    """A completion's text: itself, or the content of its last message when it is conversational
    (`[{"role": "assistant", "content": ...}]`, as TRL passes completions of conversational prompts)."""
    return completion if isinstance(completion, str) else str(completion[-1]["content"])


def is_correct(completion: str, reference: str, answer_from: str = "tags") -> bool:
    """Whether the answer of `completion` (taken per `answer_from`, see the module doc) equals `reference`."""
    answer = natural_answer(completion) if answer_from == "text" else extract_answer(completion)
    return answer is not None and answers_equal(answer, reference)


def format_reward(amount: float) -> Callable[..., list[float]]:
    """The built-in `format`: `amount` for each completion in the paper's format, else 0."""
    def format_(prompts, completions, **columns) -> list[float]:
        return [amount if _FORMAT.match(completion_text(c)) else 0.0 for c in completions]

    return format_


def correctness_reward(amount: float, answer_from: str = "tags") -> Callable[..., list[float]]:
    """The built-in `correct`: `amount` for each completion whose answer equals its row's `answer`, else 0."""
    def correct(prompts, completions, answer, **columns) -> list[float]:
        return [amount if is_correct(completion_text(c), a, answer_from) else 0.0 for c, a in zip(completions, answer)]

    return correct


def builtin(name: str, cfg: TaskConfig) -> Callable[..., list[float]]:
    """The built-in reward function `name` (`format` or `correct`) with the task's amounts."""
    return format_reward(cfg.format_reward) if name == "format" else correctness_reward(cfg.correct_reward, cfg.answer_from)


def default_names(cfg: TaskConfig) -> list[str]:
    """The functions of a run that names none: `format` (unless its amount is 0) and `correct`."""
    return ["format", "correct"] if cfg.format_reward else ["correct"]
