"""`task=wordprob`: GSM8K-style word problems generated from templates, seeded and unlimited.

A problem is a short story about a running quantity (objects, money, a length in cm) that
`task.difficulty` operations change, each drawn from `task.ops` (+, -, x, /), every intermediate
result a positive whole number, then a question. The numbers grow with the difficulty too:

    Mia has 24 marbles. She splits them equally into 4 bags and gives one bag to Omar. Omar finds
    9 more marbles. How many marbles does Omar have now?  -> 15

The split is by the question's text, fixed for every seed: a question is held out when its digest
falls in the held-out share, so no training draw can ever equal a held-out problem, and the
held-out problems (`task.eval_size` of them) come from a fixed seed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from qerl_exp.config import TaskConfig
from qerl_exp.tasks.base import Problem
from qerl_exp.tasks.rewards import default_rewards

_EVAL_SEED = 2_718_281  # fixed: the held-out problems never move with the run's seed
_HELD_OUT_SHARE = 8  # one question text in 8 is reserved for evaluation
NAMES = (
    "Mia", "Omar", "Lena", "Ravi", "Sofia", "Tom", "Aisha", "Ben", "Chloe", "Diego", "Emma", "Felix", "Grace",
    "Hugo", "Ines", "Jack", "Kira", "Liam", "Maya", "Noah", "Olga", "Pablo", "Rosa", "Sam",
)
OBJECTS = ("apple", "marble", "sticker", "book", "cookie", "pencil", "shell", "card", "stamp", "balloon")


@dataclass(frozen=True)
class Theme:
    """How one kind of story phrases its start, each operation and the question.

    Fields are format strings over `{a}` (who holds the quantity), `{b}` (a second person), `{n}`
    (the operand) and `{x}` (an object's plural). Multiplication and division hand the quantity
    to `{b}`, who then holds it.
    """

    start: str
    add: tuple[str, ...]
    sub: tuple[str, ...]
    mul: tuple[str, ...]
    div: tuple[str, ...]
    question: str


THEMES = (
    Theme(
        start="{a} has {n} {x}.",
        add=("{a} buys {n} more {x}.", "{b} gives {a} {n} more {x}.", "{a} finds {n} more {x}."),
        sub=("{a} gives {n} of the {x} to {b}.", "{a} loses {n} {x}.", "{a} sells {n} {x}."),
        mul=("{b} has {n} times as many {x} as {a}.",),
        div=("{a} splits the {x} equally into {n} bags and gives one bag to {b}.",),
        question="How many {x} does {a} have now?",
    ),
    Theme(
        start="{a} has ${n}.",
        add=("{a} earns ${n} more.", "{b} gives {a} ${n}."),
        sub=("{a} spends ${n} on a book.", "{a} pays ${n} for lunch."),
        mul=("{b} has {n} times as much money as {a}.",),
        div=("{a} shares the money equally among {n} friends, one of whom is {b}.",),
        question="How many dollars does {a} have now?",
    ),
    Theme(
        start="{a} has a ribbon that is {n} cm long.",
        add=("{a} ties on another piece that is {n} cm long.",),
        sub=("{a} cuts {n} cm off the ribbon.",),
        mul=("{b} has a ribbon {n} times as long as {a}'s.",),
        div=("{a} cuts the ribbon into {n} equal pieces and gives one piece to {b}.",),
        question="How long, in cm, is {a}'s ribbon now?",
    ),
)
_SYMBOL = {"+": "+", "-": "-", "*": "x", "/": "/"}


def held_out(question: str) -> bool:
    """Whether a question belongs to the held-out split (by its text alone, the same for every seed)."""
    return int(hashlib.sha256(question.encode()).hexdigest()[:8], 16) % _HELD_OUT_SHARE == 0


def _operand(op: str, value: int, scale: int, rng: np.random.Generator) -> int | None:
    """A draw for `value op n` whose result is a positive whole number, or None if there is none.
    Addends grow with `scale`, factors and divisors a little."""
    if op == "+":
        return int(rng.integers(1, 10 * scale))
    if op == "-":
        return int(rng.integers(1, value)) if value > 1 else None
    if op == "*":
        return int(rng.integers(2, 3 + scale))
    divisors = [d for d in range(2, 4 + 2 * scale) if value % d == 0]
    return int(rng.choice(divisors)) if divisors else None


def make_problem(ops: list[str], rng: np.random.Generator, scale: int = 1) -> Problem:
    """One word problem whose steps are `ops`, in order.

    Args:
        ops: the operations, one per step, e.g. `["+", "/"]`.
        rng: the random stream (people, objects, theme, numbers and phrasings).
        scale: the size of the numbers: the start is below 20 * scale, addends below 10 * scale.

    Returns:
        The problem: question, the whole-number answer, and a worked solution (one equation a step).
    """
    theme = THEMES[int(rng.integers(len(THEMES)))]
    x = OBJECTS[int(rng.integers(len(OBJECTS)))] + "s"
    while True:  # redraw the numbers until every step has a whole, positive result
        people = [str(p) for p in rng.choice(NAMES, size=len(ops) + 1, replace=False)]
        a, others = people[0], people[1:]
        value = int(rng.integers(2, 20 * scale))
        sentences, steps = [theme.start.format(a=a, n=value, x=x)], []
        for op in ops:
            n = _operand(op, value, scale, rng)
            if n is None:
                break
            b = others.pop()
            phrasing = {"+": theme.add, "-": theme.sub, "*": theme.mul, "/": theme.div}[op]
            sentences.append(phrasing[int(rng.integers(len(phrasing)))].format(a=a, b=b, n=n, x=x))
            new = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
            steps.append(f"{value} {_SYMBOL[op]} {n} = {new}")
            value = new
            if op in "*/":
                a = b
        else:
            sentences.append(theme.question.format(a=a, x=x))
            return Problem(question=" ".join(sentences), answer=str(value), solution=". ".join(steps) + ".")


class WordProblemTask:
    """Generated word problems; training draws never equal a held-out problem."""

    name = "wordprob"

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        self.rewards = default_rewards(cfg)

    def _draw(self, rng: np.random.Generator, want_held_out: bool) -> Problem:
        while True:
            ops = [self.cfg.ops[i] for i in rng.integers(len(self.cfg.ops), size=self.cfg.difficulty)]
            problem = make_problem(ops, rng, scale=self.cfg.difficulty)
            if held_out(problem.question) == want_held_out:
                return problem

    def sample(self, n: int, rng: np.random.Generator) -> list[Problem]:
        return [self._draw(rng, want_held_out=False) for _ in range(n)]

    def eval_problems(self) -> list[Problem]:
        rng, seen, out = np.random.default_rng(_EVAL_SEED), set(), []
        while len(out) < self.cfg.eval_size:
            problem = self._draw(rng, want_held_out=True)
            if problem.question not in seen:
                seen.add(problem.question)
                out.append(problem)
        return out
