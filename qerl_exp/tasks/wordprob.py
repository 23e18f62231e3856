"""`task=wordprob`: GSM8K-style word problems generated from templates, seeded and unlimited.

A problem is a short story about a running quantity (objects, money, a length in cm) that
`task.difficulty` operations change, each drawn from `task.ops` (+, -, x, /), every intermediate
result a positive whole number, then a question. The numbers grow with the difficulty too:

    Mia has 24 marbles. Mia splits the marbles equally into 4 bags and gives one bag to Omar. Omar
    finds 9 more marbles. How many marbles does Omar have now?  -> 15

Two evaluation splits, each of `task.eval_size` problems and fixed for every seed (they come from
fixed seeds, never from the run's):

- `heldout`: phrased as training is (the `TRAIN` templates). A question is held out when its digest
  falls in the held-out share, so no training draw can ever equal a held-out problem.
- `ood`: out of template. Its stories come from `OOD_TEMPLATES`, whose themes (a farm, a rain barrel, a hike,
  a quiz), sentence forms, question forms, names and objects no training draw uses, and each has
  one operation more than training's `task.difficulty` (numbers of training's size). It asks
  whether RL taught arithmetic in words or the training phrasings.

Training draws come from `TRAIN` (`task.templates=base`) or from `WIDE` (`task.templates=wide`:
`TRAIN` and `WIDE_EXTRA`'s six more themes, names and objects); the held-out split always from
`TRAIN`, so runs of either setting are scored on the same problems. The template lists are data:
the tests keep every list disjoint from `OOD_TEMPLATES`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from qerl_exp.config.task import TaskConfig
from qerl_exp.tasks import reward_funcs
from qerl_exp.tasks.base import HELD_OUT, OOD, Problem, check_split

_EVAL_SEED = 2_718_281  # fixed: the held-out problems never move with the run's seed
_OOD_SEED = 1_414_213  # likewise for the out-of-template problems
_HELD_OUT_SHARE = 8  # one question text in 8 is reserved for evaluation


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

    def sentences(self) -> tuple[str, ...]:
        """Every template of the theme."""
        return (self.start, *self.add, *self.sub, *self.mul, *self.div, self.question)


@dataclass(frozen=True)
class Templates:
    """What a problem's words are drawn from.

    Args:
        themes: the kinds of story.
        names: people; a problem of k operations needs k + 1 distinct ones.
        objects: what a theme's `{x}` counts, in the plural.
    """

    themes: tuple[Theme, ...]
    names: tuple[str, ...]
    objects: tuple[str, ...]


TRAIN = Templates(
    themes=(
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
    ),
    names=("Mia", "Omar", "Lena", "Ravi", "Sofia", "Tom", "Aisha", "Ben", "Chloe", "Diego", "Emma", "Felix", "Grace",
           "Hugo", "Ines", "Jack", "Kira", "Liam", "Maya", "Noah", "Olga", "Pablo", "Rosa", "Sam"),
    objects=("apples", "marbles", "stickers", "books", "cookies", "pencils", "shells", "cards", "stamps", "balloons"),
)

# The out-of-template split's words: no theme, sentence, question, name or object of TRAIN.
OOD_TEMPLATES = Templates(
    themes=(
        Theme(
            start="On a farm, {a} looks after {n} {x}.",
            add=("{a} brings home another {n} {x} from the fair.", "Then {n} new {x} are born on the farm of {a}."),
            sub=("A storm scares away {n} of the {x} of {a}.", "{a} trades {n} {x} to a neighbour."),
            mul=("The farm of {b} keeps {n} times the number of {x} that {a} keeps.",),
            div=("{a} sorts the {x} into {n} pens of equal size, and {b} takes charge of one pen.",),
            question="What number of {x} is {a} looking after at the end?",
        ),
        Theme(
            start="A barrel belonging to {a} contains {n} liters of rainwater.",
            add=("A shower adds {n} liters to the barrel of {a}.", "{a} tops up the barrel with {n} liters."),
            sub=("{a} waters the garden with {n} liters from the barrel.",
                 "A crack lets {n} liters drain from the barrel of {a}."),
            mul=("A barrel owned by {b} contains {n} times the rainwater in the barrel of {a}.",),
            div=("{a} pours the rainwater evenly into {n} buckets, and {b} carries off one bucket.",),
            question="What volume of rainwater, in liters, does {a} end up with?",
        ),
        Theme(
            start="{a} walks {n} km on a hiking trip.",
            add=("After lunch, {a} covers {n} km more.", "{a} adds a detour of {n} km."),
            sub=("{a} turns back early and walks {n} km less.",),
            mul=("{b} hikes {n} times the distance that {a} hikes.",),
            div=("The route of {a} is cut into {n} equal stages, and {b} hikes just one of those stages.",),
            question="What total distance, in km, does {a} hike?",
        ),
        Theme(
            start="{a} scores {n} points in the first round of a quiz.",
            add=("In the next round {a} earns {n} extra points.", "A bonus question gives {a} another {n} points."),
            sub=("{a} loses {n} points for a wrong answer.",),
            mul=("{b} finishes with {n} times the score of {a}.",),
            div=("The points of {a} are divided evenly among {n} teammates, {b} being one of them.",),
            question="At the end, what is the score of {a}?",
        ),
    ),
    names=("Yuki", "Kwame", "Priya", "Lars", "Nadia", "Oscar", "Zara", "Mateo", "Hana", "Ivan", "Leila", "Tariq",
           "Wendy", "Xavier", "Bianca", "Dmitri"),
    objects=("goats", "hens", "ducks", "rabbits", "geese", "ponies", "cows", "pigs"),
)

# What `task.templates=wide` adds to TRAIN for training draws: six more themes, each with its own
# sentence and question forms, and more names and objects; nothing of OOD_TEMPLATES either.
WIDE_EXTRA = Templates(
    themes=(
        Theme(
            start="There are {n} {x} on the desk of {a}.",
            add=("{b} puts {n} extra {x} on the desk of {a}.", "Later, {a} collects {n} further {x}."),
            sub=("{a} hands out {n} {x} to classmates.", "{n} of the {x} roll off the desk of {a} and get lost."),
            mul=("The desk of {b} holds {n} times as many {x} as the desk of {a}.",),
            div=("{a} sorts the {x} into {n} equal piles and passes one pile to {b}.",),
            question="How many {x} are on the desk of {a}?",
        ),
        Theme(
            start="{a} bakes {n} muffins for a school fair.",
            add=("{a} bakes a second batch of {n} muffins.", "{b} drops off {n} muffins for {a} to sell."),
            sub=("{a} sells {n} muffins before noon.", "{a} drops {n} muffins on the floor and throws them away."),
            mul=("{b} bakes {n} times as many muffins as {a}.",),
            div=("{a} packs the muffins into {n} equal boxes and hands one box to {b}.",),
            question="How many muffins does {a} have left to sell?",
        ),
        Theme(
            start="{a} keeps {n} coins in a piggy bank.",
            add=("{a} drops {n} more coins into the piggy bank.", "{b} adds {n} coins to the savings of {a}."),
            sub=("{a} takes {n} coins out to buy a snack.",),
            mul=("The piggy bank of {b} holds {n} times as many coins as that of {a}.",),
            div=("{a} empties the piggy bank into {n} equal piles and gives one pile to {b}.",),
            question="What is the number of coins {a} has?",
        ),
        Theme(
            start="A bus driven by {a} leaves the depot with {n} passengers.",
            add=("At the next stop, {n} passengers get on the bus of {a}.",),
            sub=("At the market, {n} passengers get off the bus of {a}.",),
            mul=("The bus of {b} carries {n} times as many passengers as the bus of {a}.",),
            div=("The passengers of {a} split evenly into {n} tour groups, and {b} guides one group.",),
            question="How many passengers are with {a} now?",
        ),
        Theme(
            start="{a} practices the piano for {n} minutes.",
            add=("{a} practices {n} minutes longer in the evening.",),
            sub=("{a} cuts the practice short by {n} minutes.",),
            mul=("{b} practices {n} times as long as {a}.",),
            div=("{a} splits the practice time into {n} equal sessions, and {b} joins only one session.",),
            question="For how many minutes does {a} practice?",
        ),
        Theme(
            start="{a} saves {n} euros in January.",
            add=("In February {a} saves another {n} euros.", "{b} pays {a} back {n} euros."),
            sub=("{a} spends {n} euros on a gift.",),
            mul=("{b} saves {n} times as much as {a}.",),
            div=("{a} gives the savings in equal parts to {n} charities, and {b} runs one of them.",),
            question="How many euros does {a} hold?",
        ),
    ),
    names=("Ada", "Bruno", "Carmen", "Dev", "Elif", "Farah", "Gus", "Hiro", "Iris", "Jonas", "Kofi", "Lucia"),
    objects=("crayons", "erasers", "buttons", "beads", "badges", "pebbles", "postcards"),
)
WIDE = Templates(TRAIN.themes + WIDE_EXTRA.themes, TRAIN.names + WIDE_EXTRA.names, TRAIN.objects + WIDE_EXTRA.objects)
TEMPLATES = {"base": TRAIN, "wide": WIDE}  # task.templates: what training draws from

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


def make_problem(ops: list[str], rng: np.random.Generator, scale: int = 1, templates: Templates = TRAIN) -> Problem:
    """One word problem whose steps are `ops`, in order.

    Args:
        ops: the operations, one per step, e.g. `["+", "/"]`.
        rng: the random stream (people, objects, theme, numbers and phrasings).
        scale: the size of the numbers: the start is below 20 * scale, addends below 10 * scale.
        templates: the words: `TRAIN` (training and the held-out split) or `OOD_TEMPLATES`.

    Returns:
        The problem: question, the whole-number answer, and a worked solution (one equation a step).
    """
    theme = templates.themes[int(rng.integers(len(templates.themes)))]
    x = templates.objects[int(rng.integers(len(templates.objects)))]
    while True:  # redraw the numbers until every step has a whole, positive result
        people = [str(p) for p in rng.choice(templates.names, size=len(ops) + 1, replace=False)]
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
    """Generated word problems; training draws never equal a held-out problem, nor share a template
    with an out-of-template one."""

    name = "wordprob"
    splits = (HELD_OUT, OOD)
    columns = ("answer",)

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        self.rewards = reward_funcs.load(cfg, self.columns)

    def _draw(self, rng: np.random.Generator, want_held_out: bool = False) -> Problem:
        # held-out problems always come from TRAIN, so runs of either task.templates share them
        templates = TRAIN if want_held_out else TEMPLATES[self.cfg.templates]
        while True:
            ops = [self.cfg.ops[i] for i in rng.integers(len(self.cfg.ops), size=self.cfg.difficulty)]
            problem = make_problem(ops, rng, scale=self.cfg.difficulty, templates=templates)
            if held_out(problem.question) == want_held_out:
                return problem

    def _draw_ood(self, rng: np.random.Generator) -> Problem:
        ops = [self.cfg.ops[i] for i in rng.integers(len(self.cfg.ops), size=self.cfg.difficulty + 1)]
        return make_problem(ops, rng, scale=self.cfg.difficulty, templates=OOD_TEMPLATES)

    def sample(self, n: int, rng: np.random.Generator, start: int | None = None) -> list[Problem]:
        # new problems at every draw: no epochs (`start` is for tasks over a fixed list)
        return [self._draw(rng) for _ in range(n)]

    def eval_problems(self, split: str = HELD_OUT) -> list[Problem]:
        check_split(self, split)
        if split == HELD_OUT:
            rng, draw = np.random.default_rng(_EVAL_SEED), lambda r: self._draw(r, want_held_out=True)
        else:
            rng, draw = np.random.default_rng(_OOD_SEED), self._draw_ood
        seen, out = set(), []
        while len(out) < self.cfg.eval_size:
            problem = draw(rng)
            if problem.question not in seen:
                seen.add(problem.question)
                out.append(problem)
        return out
