"""Tasks: the answer comparison, the GSM8K/MATH file loaders, the split, and the tiny-model fit."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest

from conftest import ROOT, TINY_RUN, import_or_skip, qerl
from qerl_exp.config import TaskConfig
from qerl_exp.config.compose import compose
from qerl_exp.tasks import build_task
from qerl_exp.tasks.answer import answers_equal, last_boxed, parse_number
from qerl_exp.tasks.datasets import gsm8k_problem, load_problems, math_problem, split

GSM8K = ROOT / "tests" / "data" / "gsm8k_sample.jsonl"
MATH = ROOT / "tests" / "data" / "math_sample.jsonl"

# (predicted, reference, equal?) -- each row is a way a loose comparison goes wrong.
ANSWERS = [
    ("18", "18", True),
    ("19", "18", False),  # the first character matches: the reference evaluation's defect
    ("1", "18", False),
    ("180", "18", False),
    ("18.0", "18", True),
    ("18.", "18", True),  # a trailing full stop
    ("18 apples.", "18", True),  # units
    ("18 km/h", "18", True),
    ("5 dollars per hour", "5", True),
    ("$18.00", "18", True),  # currency and cents
    ("\\$18", "18", True),
    ("-$5", "-5", True),
    ("$-5", "-5", True),
    ("-5", "5", False),  # signs matter
    ("\u22125", "-5", True),  # unicode minus
    ("+5", "5", True),
    ("1,250", "1250", True),  # thousands separators, either side
    ("1250", "1,250", True),
    ("1{,}250", "1250", True),
    ("1\\,250", "1250", True),
    ("1,25", "125", False),  # not a thousands separator
    ("1,250", "1.25", False),
    ("3/4", "0.75", True),  # fractions and decimals
    ("\\frac{3}{4}", "0.75", True),
    ("\\dfrac34", "3/4", True),
    ("-\\frac{3}{4}", "-0.75", True),
    ("\\frac{-3}{4}", "-3/4", True),
    (".5", "1/2", True),
    ("0.333", "1/3", False),  # exact, no float tolerance
    ("0.1", "1/10", True),
    ("1e3", "1000", True),
    ("25%", "25", True),
    ("30^\\circ", "30", True),
    ("5\\text{ cm}", "5", True),
    ("\\boxed{18}", "18", True),  # \boxed{}
    ("The answer is \\boxed{18}.", "18", True),
    ("\\boxed{19}", "18", False),
    ("18", "\\boxed{18}", True),
    ("$\\frac{1}{2}$", "0.5", True),
    ("x = 5", "5", True),
    ("The answer is 18", "18", True),
    ("(5)", "5", True),
    ("18 or 19", "18", False),  # hedges are not answers
    ("18 and a half", "18", False),
    ("2 million", "2", False),
    ("12+3", "15", False),  # an expression is not the number (on arith it is the question)
    ("5x", "5", False),
    ("", "18", False),
    ("18", "", False),
    ("1/0", "1", False),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),  # symbolic: math-verify
    ("\\sqrt{3}", "\\sqrt{2}", False),
    ("1+x^2", "x^2+1", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("(2,1)", "(1,2)", False),
    ("(1, 2)", "(1,2)", True),
    ("2.5", "2\\frac{1}{2}", True),  # MATH's mixed number
    ("9\\pi", "9\\pi", True),
    ("9", "9\\pi", False),
    ("monday", "\\text{Monday}", True),  # text answers, normalized
    ("Tuesday", "\\text{Monday}", False),
]


@pytest.mark.parametrize("predicted, reference, equal", ANSWERS)
def test_answers_equal(predicted, reference, equal):
    assert answers_equal(predicted, reference) is equal


@pytest.mark.parametrize("text, value", [
    ("1,234,567", Fraction(1234567)), ("-0.50", Fraction(-1, 2)), ("\\tfrac{2}{6}", Fraction(1, 3)),
    ("£3", Fraction(3)), ("x=-2", Fraction(-2)), ("1.5 hours", Fraction(3, 2)), ("1 1/2", None),
    ("\\sqrt{4}", None), ("abc", None), ("-$-5", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_last_boxed_balances_braces_and_takes_the_last():
    assert last_boxed("first \\boxed{1}, then \\boxed{\\frac{a}{b}} done") == "\\frac{a}{b}"
    assert last_boxed("\\boxed 7") == "7"
    assert last_boxed("\\fbox{4}") == "4"
    assert last_boxed("\\boxed{unclosed") is None
    assert last_boxed("no box") is None


def test_symbolic_comparison_works_off_the_main_thread():
    """math-verify's signal-based timeout fails in threads; we run it without one there."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(answers_equal, "\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}").result()


# --- loaders ---------------------------------------------------------------------------------


def test_gsm8k_fixture_loads():
    problems = load_problems(GSM8K, gsm8k_problem)
    assert 20 <= len(problems) <= 40
    assert len({p.question for p in problems}) == len(problems)
    for p in problems:
        assert parse_number(p.answer) is not None
        assert "<<" not in p.solution and "####" not in p.solution and p.solution
    first = problems[0]
    assert (first.answer, first.solution) == ("60", "12*5=60")
    assert any(p.answer == "1,200" for p in problems) and any(p.answer == "-7" for p in problems)


def test_gsm8k_fixture_fits_the_embedded_model():
    """The embedded model's tokenizer covers the fixture, and its warm-up target (the reference
    completion) fits the default 32-token completion budget, so warm-up and RL can succeed."""
    from qerl_exp.models.tokenizers import CharTokenizer
    from qerl_exp.tasks import reference_completion

    tok = CharTokenizer()
    for p in load_problems(GSM8K, gsm8k_problem):
        assert len(tok.encode(reference_completion(p))) <= 32, p
        assert len(tok.encode(p.question)) + 32 < 256, p  # the tiny model's positions


def test_math_fixture_loads_boxed_and_explicit_answers():
    problems = load_problems(MATH, math_problem)
    answers = [p.answer for p in problems]
    assert answers[:3] == ["\\frac{3}{4}", "5\\sqrt{2}", "6"]
    assert "42" in answers  # the explicit `answer` field wins over the solution
    assert "5" in answers  # a row with `answer` and no solution
    assert "x+1" in answers  # `question` instead of `problem`


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_malformed_gsm8k_file_names_every_bad_line(tmp_path):
    good = json.dumps({"question": "Two plus two?", "answer": "2+2=<<2+2=4>>4\n#### 4"})
    bad = _write(tmp_path / "bad.jsonl", [
        good,
        "",  # blank lines are fine
        '{"question": "broken", "answer": ',
        json.dumps({"question": "No final line?", "answer": "It is 4."}),
        json.dumps({"answer": "#### 4"}),
        json.dumps({"question": "Words?", "answer": "#### four"}),
        json.dumps(["a", "list"]),
        good,
    ])
    with pytest.raises(ValueError) as err:
        load_problems(bad, gsm8k_problem)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{bad}: 5 malformed lines: line 3: not valid JSON")
    for expected in ["line 4: field 'answer' has no final line '#### <number>'", "line 5: missing field 'question'",
                     "line 6: final answer 'four' after '####' is not a number", "line 7: not a JSON object"]:
        assert expected in message
    assert "line 1:" not in message and "line 8:" not in message


def test_many_malformed_lines_are_summarized(tmp_path):
    bad = _write(tmp_path / "bad.jsonl", ["{"] * 9)
    with pytest.raises(ValueError, match=r"9 malformed lines: line 1: .*line 5: .*; and 4 more$"):
        load_problems(bad, gsm8k_problem)


def test_malformed_math_file_and_missing_file(tmp_path):
    bad = _write(tmp_path / "bad.jsonl", [json.dumps({"problem": "1+1?", "solution": "It is 2."})])
    with pytest.raises(ValueError, match=r"line 1: no 'answer' field and no \\boxed"):
        load_problems(bad, math_problem)
    with pytest.raises(FileNotFoundError, match="is not a file"):
        load_problems(tmp_path / "nope.jsonl", gsm8k_problem)


def test_parquet_files_load_like_jsonl(tmp_path):
    pq = import_or_skip("pyarrow.parquet")
    import pyarrow as pa

    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert load_problems(path, gsm8k_problem) == load_problems(GSM8K, gsm8k_problem)
    # as a run composes it: task=gsm8k task.path=file.parquet
    task = build_task(compose(["task=gsm8k", f"task.path={path}", "task.eval_size=6"])[0].task)
    from_jsonl = build_task(TaskConfig(name="gsm8k", path=str(GSM8K), eval_size=6))
    assert task.eval_problems() == from_jsonl.eval_problems() and task.train == from_jsonl.train


# --- the split and the task objects ----------------------------------------------------------


def test_split_is_deterministic_disjoint_and_nested():
    problems = load_problems(GSM8K, gsm8k_problem)
    train, held = split(problems, 8)
    assert (train, held) == split(problems, 8)
    assert len(held) == 8 and len(train) == len(problems) - 8
    assert not {p.question for p in train} & {p.question for p in held}
    assert set(split(problems, 4)[1]) <= set(held)


def test_split_caps_a_small_file_at_a_quarter():
    problems = load_problems(GSM8K, gsm8k_problem)
    with pytest.warns(UserWarning, match="holding out 8"):
        train, held = split(problems, 200)
    assert len(held) == len(problems) // 4 and len(train) == len(problems) - len(held)


def test_build_task_gsm8k_from_a_file():
    cfg = TaskConfig(name="gsm8k", path=str(GSM8K), eval_size=6)
    task = build_task(cfg)
    assert task.name == "gsm8k" and len(task.eval_problems()) == 6
    held = {p.question for p in task.eval_problems()}
    drawn = task.sample(200, np.random.default_rng(0))
    assert not {p.question for p in drawn} & held, "training draws a held-out problem"
    assert task.sample(5, np.random.default_rng(1)) == task.sample(5, np.random.default_rng(1))
    assert len({p.question for p in task.sample(10, np.random.default_rng(2))}) == 10  # no repeats in a batch
    assert task.fingerprint == build_task(cfg).fingerprint != build_task(TaskConfig(name="gsm8k", path=str(GSM8K), eval_size=5)).fingerprint
    p = task.eval_problems()[0]
    scores = task.rewards.compute([p], [f"<think>{p.solution}</think><answer>{p.answer}</answer>"], "a test")
    assert scores == {"format": [0.2], "correct": [2.0]}


def _rows(tmp_path, questions: list[str]):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "answer": str(i)}) + "\n" for i, q in enumerate(questions)))
    return str(path)


def test_the_users_data_trains_as_given(tmp_path):
    """Duplicates are kept (and counted) unless asked; eval_size=0 trains on every row; a held-out
    prompt never trains, whichever rows repeat it."""
    questions = [f"q{i}" for i in range(12)] + ["q0", "q0", "q5"]
    path = _rows(tmp_path, questions)
    kept = build_task(TaskConfig(name="dataset", path=path, eval_size=0))
    assert [p.question for p in kept.train] == questions and kept.held_out == []
    assert kept.facts == {"data/train_prompts": 15, "data/held_out_prompts": 0, "data/duplicate_prompts": 3}
    dropped = build_task(TaskConfig(name="dataset", path=path, eval_size=0, drop_duplicates=True))
    assert [p.question for p in dropped.train] == questions[:12] and dropped.facts["data/duplicate_prompts"] == 3
    held = build_task(TaskConfig(name="dataset", path=path, eval_size=3))
    out = {p.question for p in held.held_out}
    assert len(out) == 3 and not out & {p.question for p in held.train}
    assert len(held.train) == 15 - sum(questions.count(q) for q in out)  # every copy of a held-out prompt is out
    # the held-out slice is the one a file without duplicates gives (the same prompts as when they were dropped)
    assert out == {p.question for p in build_task(TaskConfig(name="dataset", path=path, eval_size=3,
                                                             drop_duplicates=True)).held_out}


def test_the_epoch_sampler_draws_every_prompt_once_an_epoch(tmp_path):
    task = build_task(TaskConfig(name="dataset", path=_rows(tmp_path, [f"q{i}" for i in range(10)]), eval_size=0), seed=3)
    rng = np.random.default_rng(0)
    draws = [p.question for step in range(7) for p in task.sample(3, rng, start=3 * step)]  # 21 draws: 2.1 epochs
    epochs = [draws[:10], draws[10:20]]
    assert all(sorted(e) == sorted(f"q{i}" for i in range(10)) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[0] != [f"q{i}" for i in range(10)]  # shuffled, anew each epoch
    # a function of (seed, position) alone: a resumed run draws what the uninterrupted one did
    assert [p.question for p in task.sample(4, np.random.default_rng(9), start=8)] == draws[8:12]
    other = build_task(TaskConfig(name="dataset", path=task.cfg.path, eval_size=0), seed=4)
    assert [p.question for p in other.sample(10, rng, start=0)] != epochs[0]  # the seed orders it
    assert task.epoch(21) == pytest.approx(2.1)


def test_no_held_out_problems_means_no_evaluation(tmp_path):
    from qerl_exp.run.console import UsageError
    from qerl_exp.cli import validate

    path = _rows(tmp_path, [f"q{i}" for i in range(8)])
    with pytest.raises(UsageError, match="^eval.every needs held-out problems, and task.eval_size=0 holds none out"):
        validate(["task=dataset", f"task.path={path}", "task.eval_size=0", "eval.every=2",
                  "task.reward_funcs=[format]"], multirun=False, check_machine=False)
    cfg = compose(["task=dataset", f"task.path={path}", "task.eval_size=0", f"task.eval_path={path}", "eval.every=2",
                   "task.reward_funcs=[format]"])[0]
    assert cfg.task.holds_out


def test_build_task_math_scores_symbolic_answers():
    task = build_task(TaskConfig(name="math", path=str(MATH), eval_size=5))
    problems = {p.answer: p for p in task.train + task.held_out}
    half, root = problems["\\dfrac{1}{2}"], problems["\\frac{\\sqrt{2}}{2}"]
    answers = ["0.5", "\\frac{1}{\\sqrt{2}}", "\\sqrt{2}"]
    scores = task.rewards.compute([half, root, root], [f"<think>.</think><answer>{a}</answer>" for a in answers], "a test")
    assert scores["correct"] == [2.0, 2.0, 0.0]


def test_file_tasks_say_what_is_missing():
    with pytest.raises(ValueError, match="task=math needs task.path="):
        build_task(TaskConfig(name="math"))
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="needs the `datasets` package .* or pass task.path="):
            build_task(TaskConfig(name="gsm8k"))


@pytest.mark.slow
def test_gsm8k_run_from_the_fixture(tmp_path):
    """`python -m qerl_exp task=gsm8k task.path=...` trains (a short warm-up keeps it cheap)."""
    run_dir = tmp_path / "run"
    out = qerl("task=gsm8k", f"task.path={GSM8K}", "train.steps=3", *TINY_RUN, "model.warmup.max_steps=30",
               "model.warmup.batch_size=16", f"model.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all("rewards/correct/mean" in r for r in rows)
    assert json.loads((run_dir / "config.json").read_text())["task"]["path"] == str(GSM8K)
