"""task=wordprob: generated word problems, their fixed splits (in and out of template), and the
natural-answer reward."""

from __future__ import annotations

import re

import numpy as np
import pytest

from qerl_exp.config import ConfigError, TaskConfig
from qerl_exp.config.compose import compose
from qerl_exp.tasks import build_task
from qerl_exp.tasks.rewards import correctness_reward, natural_answer
from qerl_exp.tasks.wordprob import OOD_TEMPLATES, TRAIN, WIDE, WIDE_EXTRA, Templates, held_out

OPS = ["+", "-", "*", "/"]


def task(**kw):
    return build_task(TaskConfig(**{"name": "wordprob", "ops": OPS, "format_reward": 0.0, "answer_from": "text", **kw}))


# (reply, reference, judged correct?) -- the forms an instruct model writes, and near misses.
REPLIES = [
    ("Mia has 24 - 5 = 19 apples left.\n#### 19", "19", True),
    ("#### 19 apples", "19", True),
    ("She has 19 apples. The answer is 19.", "19", True),
    ("The answer is: $1,250.", "1250", True),
    ("So the final answer is **19**", "19", True),
    ("24 - 5 = 19, so she has \\boxed{19} apples.", "19", True),
    ("First 24 - 5 = 19. Then she has 19 apples", "19", True),  # the last number
    ("<think>24-5</think><answer>19</answer> then 7", "19", True),  # tags win over the last number
    ("She has 19 apples. The answer is 18.", "19", False),  # the stated answer, not an earlier number
    ("\\boxed{18} and then 19", "19", False),  # the box wins
    ("#### 19.5", "19", False),
    ("It has 5, 7, and 12 apples, 1,000 in all", "1000", True),
    ("I do not know.", "19", False),
    ("She has -3 apples", "-3", True),
]


@pytest.mark.parametrize("reply, reference, ok", REPLIES)
def test_natural_answer_forms(reply, reference, ok):
    reward = correctness_reward(2.0, "text")
    assert reward(["q"], [reply], answer=[reference]) == [2.0 if ok else 0.0], natural_answer(reply)


def test_tags_mode_keeps_the_papers_reward():
    reward = correctness_reward(2.0, "tags")
    assert reward(["q", "q"], ["The answer is 19.", "<think>x</think><answer>19</answer>"], answer=["19", "19"]) == [0.0, 2.0]


def _replay(solution: str) -> int:
    """Recompute an answer from the worked steps ("a op n = c."), checking each step's arithmetic."""
    value = None
    for a, op, n, c in re.findall(r"(\d+) ([-+x/]) (\d+) = (\d+)\.", solution):
        a, n, c = int(a), int(n), int(c)
        assert value is None or a == value, solution
        exact = {"+": a + n, "-": a - n, "x": a * n, "/": a / n}[op]
        assert exact == c and c > 0, solution  # whole and positive at every step
        value = c
    return value


@pytest.mark.parametrize("difficulty", [1, 2, 3])
@pytest.mark.parametrize("templates", ["base", "wide"])
def test_problems_have_whole_answers_and_the_asked_number_of_steps(difficulty, templates):
    problems = task(difficulty=difficulty, templates=templates).sample(300, np.random.default_rng(difficulty))
    asks = _asks(TRAIN if templates == "base" else WIDE)
    for p in problems:
        assert len(re.findall(r" = ", p.solution)) == difficulty, p
        assert str(_replay(p.solution)) == p.answer, p
        assert any(ask.search(p.question) for ask in asks) and p.answer not in ("", "0"), p  # ends in a question
    used = {op for p in problems for op in re.findall(r"\d+ ([-+x/]) \d+ =", p.solution)}
    assert used == {"+", "-", "x", "/"}
    assert len({p.question for p in problems}) > 0.95 * len(problems)


def test_train_and_held_out_never_overlap_and_the_split_is_fixed():
    t = task(difficulty=1, eval_size=300)
    held = t.eval_problems()
    assert len(held) == 300 and len({p.question for p in held}) == 300
    assert [p.question for p in held] == [p.question for p in task(difficulty=1, eval_size=300).eval_problems()]
    assert all(held_out(p.question) for p in held)
    questions = {p.question for p in held}
    drawn = [p for seed in range(5) for p in t.sample(2000, np.random.default_rng(seed))]
    assert not any(p.question in questions or held_out(p.question) for p in drawn)
    # the generator does produce held-out questions: without the filter, some draws would leak
    from qerl_exp.tasks.wordprob import make_problem

    rng = np.random.default_rng(0)
    assert any(held_out(make_problem(["+"], rng).question) for _ in range(500))
    # a smaller eval_size is a prefix of a larger one
    assert [p.question for p in task(difficulty=1, eval_size=50).eval_problems()] == [p.question for p in held[:50]]


def _patterns(templates: Templates) -> list[str]:
    """Each template sentence as a regex over the words the generator puts in: names and objects
    are single words, operands whole numbers."""
    fill = {"{a}": "[A-Z][a-z]+", "{b}": "[A-Z][a-z]+", "{x}": "[a-z]+", "{n}": r"\d+"}
    return ["".join(fill.get(part, re.escape(part)) for part in re.split(r"(\{[abnx]\})", sentence))
            for theme in templates.themes for sentence in theme.sentences()]


def _asks(templates: Templates) -> list[re.Pattern]:
    """Each theme's question as a regex anchored at the end of a problem."""
    return [re.compile(_patterns(Templates((theme,), (), ()))[-1] + "$") for theme in templates.themes]


@pytest.mark.parametrize("train", [TRAIN, WIDE], ids=["base", "wide"])
def test_the_out_of_template_words_share_nothing_with_training(train):
    sentences = [{s for t in words.themes for s in t.sentences()} for words in (train, OOD_TEMPLATES)]
    assert sentences[0].isdisjoint(sentences[1])
    questions = [{t.question for t in words.themes} for words in (train, OOD_TEMPLATES)]
    assert questions[0].isdisjoint(questions[1]) and all(len(q) == len(w.themes) for q, w in zip(questions, (train, OOD_TEMPLATES)))
    assert set(train.names).isdisjoint(OOD_TEMPLATES.names) and set(train.objects).isdisjoint(OOD_TEMPLATES.objects)


def test_wide_templates_add_new_words_to_training_and_leave_both_splits_alone():
    # WIDE is TRAIN and WIDE_EXTRA, whose every theme, sentence, question, name and object is new
    assert WIDE.themes == TRAIN.themes + WIDE_EXTRA.themes and len(WIDE_EXTRA.themes) >= 6
    base_sentences = {s for t in TRAIN.themes for s in t.sentences()}
    assert not base_sentences & {s for t in WIDE_EXTRA.themes for s in t.sentences()}
    assert not set(TRAIN.names) & set(WIDE_EXTRA.names) and not set(TRAIN.objects) & set(WIDE_EXTRA.objects)
    base, wide = task(difficulty=2, eval_size=200), task(difficulty=2, eval_size=200, templates="wide")
    for split in ("heldout", "ood"):
        assert [p.question for p in wide.eval_problems(split)] == [p.question for p in base.eval_problems(split)]
    held = {p.question for p in base.eval_problems()}
    drawn = [p.question for seed in range(3) for p in wide.sample(1000, np.random.default_rng(seed))]
    assert not any(q in held or held_out(q) for q in drawn)
    # every extra theme is drawn, and the base themes still are
    assert all(any(ask.search(q) for q in drawn) for ask in _asks(WIDE))
    assert sum(any(n in q.split()[:8] for n in WIDE_EXTRA.names) for q in drawn) > 0.2 * len(drawn)


@pytest.mark.parametrize("difficulty", [1, 3])
@pytest.mark.parametrize("templates", ["base", "wide"])
def test_out_of_template_questions_match_no_training_template_and_have_one_more_step(difficulty, templates):
    t = task(difficulty=difficulty, eval_size=300, templates=templates)
    ood = t.eval_problems("ood")
    drawn = t.sample(300, np.random.default_rng(0)) + t.eval_problems()
    train_patterns, ood_patterns = _patterns(TRAIN if templates == "base" else WIDE), _patterns(OOD_TEMPLATES)
    for questions, own, other in (([p.question for p in ood], ood_patterns, train_patterns),
                                  ([p.question for p in drawn], train_patterns, ood_patterns)):
        alternatives = "|".join(own)
        whole = re.compile(f"(?:{alternatives})(?: (?:{alternatives}))*")
        foreign = re.compile("|".join(other))
        for q in questions:
            assert whole.fullmatch(q), q  # sentence by sentence, its own templates (the patterns work)
            assert not foreign.search(q), q  # and not one sentence of the other set's
    for p in ood:
        assert len(re.findall(r" = ", p.solution)) == difficulty + 1, p
        assert str(_replay(p.solution)) == p.answer, p
    used = {op for p in ood for op in re.findall(r"\d+ ([-+x/]) \d+ =", p.solution)}
    assert used == {"+", "-", "x", "/"} and len({p.question for p in ood}) == 300
    # fixed for every seed and every call; a smaller eval_size is a prefix of a larger one
    assert [p.question for p in task(difficulty=difficulty, eval_size=300).eval_problems("ood")] == [p.question for p in ood]
    assert [p.question for p in task(difficulty=difficulty, eval_size=40).eval_problems("ood")] == [p.question for p in ood[:40]]


def test_a_split_the_task_lacks_is_refused_in_one_line():
    assert task().splits == ("heldout", "ood")
    arith = build_task(TaskConfig(name="arith"))
    assert arith.splits == ("heldout",)
    with pytest.raises(ValueError, match=r"^split='ood' is not a split of task arith; choose one of: heldout$"):
        arith.eval_problems("ood")
    with pytest.raises(ValueError, match=r"^split='test' is not a split of task wordprob; choose one of: heldout, ood$"):
        task().eval_problems("test")


def test_preset_turns_the_format_reward_off_and_judges_natural_answers():
    cfg = compose(["task=wordprob"])[0]
    t = build_task(cfg.task)
    assert t.rewards.names == ["correct"] and cfg.task.answer_from == "text"
    p = t.eval_problems()[0]
    assert t.rewards.compute([p], [f"Step by step.\n#### {p.answer}"], "a test") == {"correct": [cfg.task.correct_reward]}
    # the other tasks keep both of the paper's rewards
    assert build_task(compose([])[0].task).rewards.names == ["format", "correct"]


@pytest.mark.parametrize("kw, message", [
    ({"difficulty": 4}, "task.difficulty must be in 1..3 for task.name=wordprob"),
    ({"ops": ["+", "%"]}, "task.ops entry='%' is not valid"),
    ({"answer_from": "last"}, "task.answer_from='last' is not valid"),
    ({"templates": "narrow"}, "task.templates='narrow' is not valid"),
])
def test_bad_wordprob_settings_are_refused(kw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        TaskConfig(name="wordprob", **kw)
    with pytest.raises(ConfigError, match="task.ops entry='/' is not valid"):
        TaskConfig(name="arith", ops=["/"])
    with pytest.raises(ConfigError, match=re.escape("task.templates=wide is for task.name=wordprob; leave it at base for task.name=arith")):
        TaskConfig(name="arith", templates="wide")
