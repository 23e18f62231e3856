"""What every task is made of: `Problem`, the `Task` protocol, its evaluation splits (named in
`qerl_exp.config.splits`), and a problem's reference completion. The task modules import these from here,
so that the package (`qerl_exp.tasks`) can import the task modules at its top."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import numpy as np

from qerl_exp.config.splits import HELD_OUT, OOD, SPLITS  # noqa: F401 - the splits a task declares
from qerl_exp.tasks.reward_funcs import Rewards

# A prompt as reward functions get it: text (TRL's standard format), or a list of
# `{"role": ..., "content": ...}` messages (TRL's conversational format).
Prompt = str | list[dict[str, Any]]


@dataclass(frozen=True)
class Problem:
    """One problem: what the model is asked, the reference answer, and its row's other columns.

    Args:
        question: the prompt as text; for a conversational prompt, its last user message (what
            evaluation files show, and what tells problems apart with `messages`).
        answer: the reference answer, as text; None for a prompt-only data set (reward functions
            then get no `answer`).
        solution: a worked solution (the embedded model's warm-up imitates it); may be empty.
        completion: the whole reference reply of a task whose replies are not in the paper's
            format (`tasks.fork`); empty: `reference_completion` writes it from `solution`.
        messages: a conversational prompt's messages, rendered by the chat template as they are;
            empty for a text prompt.
        columns: the row's other columns (neither the prompt nor the answer), which reward
            functions get as keyword lists beside `answer`.
        source: where a file-backed problem was read (`FILE line N`), for messages about it.
    """

    question: str
    answer: str | None
    solution: str = ""
    completion: str = ""
    messages: tuple[dict[str, Any], ...] = field(default=(), hash=False)
    columns: Mapping[str, Any] = field(default_factory=dict, hash=False)
    source: str = field(default="", compare=False)

    @property
    def prompt(self) -> Prompt:
        """What the tokenizer renders and reward functions get as the prompt: the messages of a
        conversational prompt (a new list each time), else the question."""
        return [dict(m) for m in self.messages] if self.messages else self.question



def reference_completion(problem: Problem) -> str:
    """The problem's reference reply (its worked solution and answer in the paper's format, unless
    the task gives its own): what the embedded model's warm-up imitates and what evaluation's
    `eval/solution_logp` scores."""
    return problem.completion or f"<think>{problem.solution}</think><answer>{problem.answer or ''}</answer>"


class Task(Protocol):
    """A task. Optional, for a task with metrics of its own (named in `qerl_exp.rl.metrics`):
    `step_metrics(texts, route_entropy)` on each step's completions and the sampler's entropy at
    their first token, and `eval_metrics(greedy, prefix)` on an evaluation's greedy replies
    (`tasks.fork`)."""

    name: str
    rewards: Rewards  # the run's reward functions (`task.reward_funcs`)
    splits: tuple[str, ...]  # its evaluation splits, HELD_OUT first
    columns: tuple[str, ...]  # the keyword lists its reward functions get: `answer` and the rows' other columns

    def sample(self, n: int, rng: np.random.Generator, start: int | None = None) -> list[Problem]:
        """`n` training problems drawn with `rng` (the run's data stream); a task over a fixed list
        of problems (`datasets.FileTask`) takes `start`, the number drawn before, to draw them epoch
        by epoch instead (`task.sampler=epoch`); a generated task makes new ones either way."""
        ...

    def eval_problems(self, split: str = HELD_OUT) -> list[Problem]:
        """The problems of one of `splits`, the same on every call and for every seed."""
        ...


def check_split(task: Task, split: str) -> None:
    """Raise a one-line `ValueError` unless `split` is one of the task's evaluation splits."""
    if split not in task.splits:
        raise ValueError(f"split={split!r} is not a split of task {task.name}; choose one of: {', '.join(task.splits)}")


def epochs_done(task: Task, step: int, prompts_per_step: int, steps: int) -> float:
    """The passes over the training prompts that `step` steps have drawn (TRL's fractional epoch); a
    generated task, which has no fixed prompts, counts the run of `steps` steps as one."""
    if hasattr(task, "epoch"):
        return task.epoch(step * prompts_per_step)
    return step / steps
