"""Your own task, end to end: docs/own_task.md's example (reward functions in TRL's signature, a
conversational JSONL with a `difficulty` column, a preset in a folder of its own) run as written on
a small random Qwen2 checkpoint whose tokenizer has a chat template; the same data from a
save_to_disk folder and a Parquet file; `completions.jsonl` across a resume; the one-line refusals."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, SUBPROCESS_ENV, metrics_rows, run_in_process, tiny_qwen2
from qerl_exp.cli import parse_command_line, validate
from qerl_exp.config.compose import compose
from qerl_exp.run.console import UsageError

DOC = ROOT / "docs" / "own_task.md"
SMALL = ["tracker.mode=disabled", "train.prompts_per_step=2", "algo.group_size=4", "monitor.every=0",
         "algo.max_new_tokens=16"]
# A ChatML template that, like Qwen3's, leaves the thinking block empty when told `enable_thinking=false`.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")


def doc_files() -> dict[str, str]:
    """The files docs/own_task.md shows: a bold `name` line, then its fenced block."""
    found = re.findall(r"^\*\*`([^`]+)`\*\*(?:[^\n]*\n)*?\n```\w*\n(.*?)^```", DOC.read_text(), re.MULTILINE | re.DOTALL)
    return dict(found)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random Qwen2 saved by `save_pretrained`, with a byte-level tokenizer made here (no download)
    whose chat template is `TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("checkpoint")
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    tiny_qwen2(vocab=len(vocab), hidden=64, inter=128, max_positions=512).save_pretrained(folder)
    return folder


@pytest.fixture
def example(tmp_path) -> Path:
    """docs/own_task.md's files, written into a folder as a researcher would copy them."""
    files = doc_files()
    assert set(files) == {"rewards.py", "data.jsonl", "myconf/task/mine.yaml"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def command(folder: Path, *args: str, module: str = "qerl_exp", env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` run in `folder`, as a researcher runs it from theirs."""
    env = {**SUBPROCESS_ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=folder, capture_output=True, text=True,
                          timeout=600, env=env)


def completions(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]


def sha16(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@pytest.mark.slow
def test_the_documented_example_trains_logs_and_evaluates_with_its_functions(example, checkpoint):
    out = command(example, f"model.name={checkpoint}", "task=dataset", "task.path=data.jsonl",
                  "task.reward_funcs=[rewards.py:fmt,rewards.py:correct]", "task.reward_weights=[0.5,2.0]",
                  "train.steps=3", *SMALL, "tracker.completions_every=1", "run_dir=run")
    assert out.returncode == 0, out.stderr[-3000:]
    run = example / "run"
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for name in ("rewards/fmt/mean", "rewards/fmt/std", "rewards/correct/mean", "rewards/correct/std"):
        assert all(name in r for r in rows), name
    assert not any("rewards/format/mean" in r for r in rows)  # the built-in functions are not the run's
    samples = completions(run)
    assert [s["step"] for s in samples] == [step for step in range(3) for _ in range(8)]
    for s in samples:
        assert set(s) == {"step", "prompt", "completion", "rewards", "reward", "advantage"}
        assert s["prompt"].startswith("<|im_start|>") and s["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
        values = s["rewards"]
        weighted = [w * v for w, v in ((0.5, values["fmt"]), (2.0, values["correct"])) if v is not None]
        assert s["reward"] == pytest.approx(sum(weighted))
    for r in rows:  # unweighted, over the step's completions
        fmt = [s["rewards"]["fmt"] for s in samples if s["step"] == r["step"]]
        assert r["rewards/fmt/mean"] == pytest.approx(statistics.mean(fmt))
    config = json.loads((run / "config.json").read_text())
    assert config["task"]["reward_funcs"] == [f"{example}/rewards.py:fmt", f"{example}/rewards.py:correct"]  # resolved
    assert config["task"]["reward_weights"] == [0.5, 2.0]
    digest = sha16(example / "rewards.py")
    assert config["reward_files"] == {"fmt": {"file": f"{example}/rewards.py", "sha256": digest},
                                      "correct": {"file": f"{example}/rewards.py", "sha256": digest}}
    assert config["task_sha256"] == {"path": sha16(example / "data.jsonl")}

    ev = command(example, "run_dir=run", "k=1", "limit=4", "tracker=disabled", module="qerl_exp.eval")
    assert ev.returncode == 0, ev.stderr[-3000:]
    record = json.loads((run / "eval.json").read_text())
    assert record["metrics"]["eval/problems"] == 4
    scored = record["problems"]
    assert all(set(p["rewards"]) == {"fmt", "correct"} for p in scored)  # the run's own functions
    totals = [sum(w * v for w, v in ((0.5, p["rewards"]["fmt"]), (2.0, p["rewards"]["correct"])) if v is not None)
              for p in scored]
    assert record["metrics"]["eval/reward"] == pytest.approx(statistics.mean(totals))
    assert math.isnan(record["metrics"]["eval/format"])  # the run has no function named format


@pytest.mark.slow
def test_a_preset_in_a_folder_of_its_own_runs_with_its_chat_settings(example, checkpoint):
    shown = command(example, "--config-dir", "myconf", "task=mine", f"model.name={checkpoint}", "--cfg", "job")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "path: data.jsonl" in shown.stdout and "- rewards.py:fmt" in shown.stdout

    out = command(example, "--config-dir", "myconf", "task=mine", f"model.name={checkpoint}", "train.steps=2", *SMALL,
                  "run_dir=run")
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads((example / "run" / "config.json").read_text())
    assert config["choices"]["task"] == "mine"
    assert config["task"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert config["task"]["reward_weights"] == [0.5, 2.0]
    assert all(s["prompt"].endswith("<|im_start|>assistant\n<think></think>") for s in completions(example / "run"))
    assert "rewards/correct/std" in metrics_rows(example / "run")[0]


@pytest.mark.slow
def test_save_to_disk_folders_and_parquet_files_train_and_evaluate_as_the_jsonl_does(example, checkpoint):
    import datasets

    from qerl_exp.config import EvalConfig
    from qerl_exp.eval.__main__ import EvalCommand, evaluate_run
    from qerl_exp.tasks import build_task

    data = datasets.load_dataset("json", data_files=str(example / "data.jsonl"))["train"]
    data.save_to_disk(str(example / "saved"))
    data.to_parquet(str(example / "data.parquet"))
    funcs = f"task.reward_funcs=[{example}/rewards.py:fmt,{example}/rewards.py:correct]"
    common = [f"model.name={checkpoint}", "task=dataset", funcs, "task.reward_weights=[0.5,2.0]", *SMALL]
    jsonl = build_task(compose([*common, f"task.path={example / 'data.jsonl'}"])[0].task)
    questions = None
    for source in ("saved", "data.parquet"):
        overrides = [*common, f"task.path={example / source}", "train.steps=2"]
        task = build_task(compose(overrides)[0].task)
        assert (task.train, task.held_out) == (jsonl.train, jsonl.held_out), source  # the same problems, columns and all
        assert task.conversational and task.columns == ("answer", "difficulty")
        rows = run_in_process(example / f"run-{source}", *overrides)
        assert [r["step"] for r in rows] == [0, 1] and "rewards/fmt/mean" in rows[0], source
        metrics = evaluate_run(EvalCommand(run_dir=str(example / f"run-{source}"), eval=EvalConfig(k=1), limit=4,
                                           tracker="disabled"))
        assert metrics["eval/problems"] == 4
        record = json.loads((example / f"run-{source}" / "eval.json").read_text())
        assert questions in (None, [p["question"] for p in record["problems"]])
        questions = [p["question"] for p in record["problems"]]


# A reward file whose values a random model's replies make non-zero, with None on some rows.
COUNTING = '''
def chars(prompts, completions, **kwargs):
    return [len(c[0]["content"]) / 10 for c in completions]


def hard(prompts, completions, difficulty, **kwargs):
    return [None if d is None or d < 2 else d * (len(c[0]["content"]) % 3) for c, d in zip(completions, difficulty)]
'''


class _Stop(Exception):
    """Ends an in-process run after a step."""


@pytest.mark.slow
def test_completions_follow_the_metrics_and_a_resume_and_an_edited_reward_file_is_refused(example, checkpoint):
    from qerl_exp.run.rundir import ConfigChangedError

    (example / "counting.py").write_text(COUNTING)
    overrides = [f"model.name={checkpoint}", "task=dataset", f"task.path={example / 'data.jsonl'}",
                 f"task.reward_funcs=[{example}/counting.py:chars,{example}/counting.py:hard]",
                 "task.reward_weights=[0.5,2.0]", "train.steps=4", "checkpoint.every=2", "tracker.completions_every=1",
                 *SMALL]
    whole = run_in_process(example / "whole", *overrides)

    def stop(step, metrics):
        if step == 2:
            raise _Stop

    with pytest.raises(_Stop):
        run_in_process(example / "cut", *overrides, on_step=stop)
    assert {s["step"] for s in completions(example / "cut")} == {0, 1, 2}
    kept = (example / "cut" / "metrics.jsonl").read_text()
    (example / "counting.py").write_text(COUNTING + "# edited\n")
    with pytest.raises(ConfigChangedError) as refused:
        run_in_process(example / "cut", *overrides)
    line = str(refused.value)
    assert "\n" not in line and "reward_files.chars.sha256" in line
    assert "a reward function's code (its source file, or a module of its folder it imports) changed since the run started" in line
    assert (example / "cut" / "metrics.jsonl").read_text() == kept  # nothing changed
    (example / "counting.py").write_text(COUNTING)
    resumed = run_in_process(example / "cut", *overrides)

    samples = completions(example / "cut")
    assert samples == completions(example / "whole")  # no row repeated, none lost, the same draws
    assert [s["step"] for s in samples] == [step for step in range(4) for _ in range(8)]
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for row in whole:  # the metrics are the completions' numbers: unweighted per function, weighted in all
        step = [s for s in samples if s["step"] == row["step"]]
        for name in ("chars", "hard"):  # over the completions a function applies to; NaN (null) over none or one
            values = [s["rewards"][name] for s in step if s["rewards"][name] is not None]
            assert row[f"rewards/{name}/mean"] == (pytest.approx(statistics.mean(values)) if values else None)
            assert row[f"rewards/{name}/std"] == (pytest.approx(statistics.stdev(values)) if len(values) > 1 else None)
        totals = [0.5 * s["rewards"]["chars"] + (2.0 * s["rewards"]["hard"] if s["rewards"]["hard"] is not None else 0)
                  for s in step]
        assert [s["reward"] for s in step] == pytest.approx(totals)
        assert row["reward"] == pytest.approx(statistics.mean(totals))
        for g in range(2):
            group = totals[4 * g:4 * g + 4]
            mean, std = statistics.mean(group), statistics.stdev(group)
            assert [s["advantage"] for s in step[4 * g:4 * g + 4]] == pytest.approx(
                [(t - mean) / (std + 1e-4) for t in group], rel=1e-4, abs=1e-5)


def test_a_reward_function_that_fails_mid_run_stops_it_at_that_step(example, checkpoint):
    from qerl_exp.tasks.reward_funcs import RewardError

    (example / "flaky.py").write_text("def late(prompts, completions, **kwargs):\n"
                                      "    if len(completions) and open(__file__ + '.step').read() == '1':\n"
                                      "        return [1.0] * (len(completions) - 1)\n"
                                      "    return [1.0] * len(completions)\n")
    (example / "flaky.py.step").write_text("0")

    def advance(step, metrics):
        (example / "flaky.py.step").write_text(str(step + 1))

    with pytest.raises(RewardError) as err:
        run_in_process(example / "run", f"model.name={checkpoint}", "task=dataset", f"task.path={example / 'data.jsonl'}",
                       f"task.reward_funcs=[{example}/flaky.py:late]", "train.steps=3", *SMALL, on_step=advance)
    assert str(err.value) == (f"reward function late ({example}/flaky.py:late) returned 7 values for 8 completions at "
                              "step 1; return one value per completion: a finite number, or None where the function "
                              "does not apply")
    assert [r["step"] for r in metrics_rows(example / "run")] == [0]  # step 0 kept as it was


@pytest.mark.parametrize("returned, message", [
    ("[float('nan')] * len(completions)", "returned nan for completion 0 at step 7; return one value per completion"),
    ("['1'] * len(completions)", "returned '1' for completion 0 at step 7"),
    ("None", "returned a NoneType at step 7, not a list"),
    ("1 / 0", "raised ZeroDivisionError at step 7: division by zero"),
])
def test_a_bad_reward_value_is_one_line_naming_the_function_and_the_step(tmp_path, returned, message):
    from qerl_exp.config import TaskConfig
    from qerl_exp.tasks import Problem
    from qerl_exp.tasks.reward_funcs import RewardError, load

    (tmp_path / "bad.py").write_text(f"def odd(prompts, completions, **kwargs):\n    return {returned}\n")
    rewards = load(TaskConfig(name="dataset", path="x", reward_funcs=[f"{tmp_path}/bad.py:odd"]), ("answer",))
    with pytest.raises(RewardError) as err:
        rewards.compute([Problem("q", "1")] * 2, ["a", "b"], "step 7")
    assert str(err.value).startswith(f"reward function odd ({tmp_path}/bad.py:odd) ") and message in str(err.value)
    assert "\n" not in str(err.value)


BAD_FUNCTIONS = [
    ("def fmt(prompts, completions, **kwargs)\n    return []\n",
     "task.reward_funcs entry rewards.py:fmt: rewards.py does not import (SyntaxError: expected ':' (rewards.py, line 1))"),
    ("import no_such_module\n",
     "task.reward_funcs entry rewards.py:fmt: rewards.py does not import (ModuleNotFoundError: No module named 'no_such_module')"),
    ("fmt = 3\n", "task.reward_funcs entry rewards.py:fmt: fmt is a int, not a function"),
    ("def other(prompts, completions, **kwargs):\n    return []\n", "rewards.py has no function 'fmt'"),
    ("def fmt(completions, answer):\n    return []\n", "reward function fmt (rewards.py:fmt) does not take 'prompts'"),
    ("def fmt(prompts, completions, level, **kwargs):\n    return []\n",
     "reward function fmt (rewards.py:fmt) needs 'level', which is not a column of the task's rows (they give: answer, "
     "difficulty) nor one of its task.reward_kwargs"),
    ("def fmt(prompts, completions, answer):\n    return []\n",
     "reward function fmt (rewards.py:fmt) does not take the column 'difficulty', and every column is passed to it; "
     "add **kwargs to its parameters"),
]


@pytest.mark.parametrize("source, message", BAD_FUNCTIONS)
def test_a_reward_function_that_cannot_run_is_refused_in_one_line_before_the_run(example, checkpoint, monkeypatch,
                                                                                    source, message):
    monkeypatch.chdir(example)
    (example / "rewards.py").write_text(source)
    with pytest.raises(UsageError) as err:
        validate([f"model.name={checkpoint}", "task=dataset", "task.path=data.jsonl", "task.reward_funcs=[rewards.py:fmt]"],
                 multirun=False)
    line = str(err.value).replace(f"{example}/", "")  # the file as the config records it: resolved
    assert message in line and "\n" not in line
    assert not (example / "runs").exists()


@pytest.mark.parametrize("overrides, message", [
    (["task=arith", "task.path=data.jsonl"], "task.path is for the tasks that read data (gsm8k, math, dataset); "
                                             "task=arith generates its problems: drop task.path, or choose task=dataset"),
    (["task=wordprob", "task.eval_split=test"], "task.eval_split is for the tasks that read data"),
    (["task=gsm8k", "task.columns.prompt=q"], "task.columns is for task=dataset"),
    (["task=dataset"], "task=dataset needs task.path=<a JSONL, JSON, CSV or Parquet file, a save_to_disk folder, or a hub dataset id>"),
    (["task=dataset", "task.path=nothing.jsonl"], "task.path=nothing.jsonl does not exist"),
    (["task=dataset", "task.path=notes.txt"], "task.path=notes.txt does not exist"),
    (["task=dataset", "task.path=data.jsonl"], "task.path=data.jsonl holds conversational prompts (lists of messages), "
                                               "which need a chat template, and the embedded model has none"),
    (["task=dataset", "task.path=data.jsonl", "task.columns.answer=solution"],
     "task.columns.answer=solution is not a column of task.path=data.jsonl (it has: prompt, answer, difficulty)"),
    (["task=dataset", "task.path=data.jsonl", "task.split=test"], "task.path=data.jsonl has no split 'test'; it has: train"),
    (["task.chat_template='{{ messages }}'"], "task.chat_template and task.chat_template_kwargs are for a checkpoint's tokenizer"),
    (["task.reward_funcs=[rewards.py:fmt]", "task.reward_weights=[1,2]"], "task.reward_weights has 2 entries for 1"),
    (["task.reward_funcs=[rewards.py]"], "task.reward_funcs entry 'rewards.py' is not path/to/file.py:function"),
    (["task=mine"], "task=mine is not a preset; choose one of: arith, dataset, fork, gsm8k, math, wordprob"),
    (["--config-dir", "myconf", "task=mien"], "task=mien is not a preset; choose one of: arith, dataset, fork, gsm8k, math, mine, wordprob"),
    (["task=mine", "--config-dir"], "argument --config-dir/-cd: expected one argument"),
    (["--config-dir", "nowhere", "task=mine"], "--config-dir=nowhere is not a folder"),
])
def test_bad_task_settings_are_one_line(example, monkeypatch, overrides, message):
    monkeypatch.chdir(example)
    with pytest.raises(UsageError) as err:
        args, flags = parse_command_line(overrides)
        validate(args, multirun=flags.multirun)
    line = str(err.value).replace(f"{example}/", "")  # a local path as the config records it: resolved
    assert message in line and "\n" not in line


def test_presets_come_from_config_dirs_and_the_search_path_alike(example, checkpoint, monkeypatch):
    monkeypatch.chdir(example)
    by_dir = parse_command_line(["--config-dir=myconf", "task=mine", f"model.name={checkpoint}", "algo.max_new_tokens=64"])[0]
    assert by_dir[-1] == f"hydra.searchpath=['file://{example}/myconf']"
    by_path = ["hydra.searchpath=[file://myconf]", "task=mine", f"model.name={checkpoint}", "algo.max_new_tokens=64"]
    (a, choices), (b, _) = compose(by_dir), compose(by_path)
    assert a == b and choices["task"] == "mine"
    assert a.task.reward_funcs == [f"{example}/rewards.py:fmt", f"{example}/rewards.py:correct"]  # recorded resolved
    assert validate(by_dir, multirun=True)[0] == a


@pytest.mark.slow
def test_a_sweep_searches_presets_of_a_config_dir(example, checkpoint, monkeypatch):
    from qerl_exp.sweep.__main__ import own_presets
    from qerl_exp.sweep.spec import load_plan

    monkeypatch.chdir(example)
    spec = {"base": [f"model.name={checkpoint}", *SMALL], "params": {"task": {"type": "categorical", "choices": ["mine"]}},
            "objective": {"metric": "rewards/correct/mean", "direction": "maximize"}, "n_trials": 1}
    plan = load_plan(example / "spec.yaml", own_presets(["--config-dir", "myconf"]), spec=spec)
    assert f"hydra.searchpath=['file://{example}/myconf']" in plan.overrides
    with pytest.raises(UsageError, match="params.task: 'mine' is not a preset"):
        load_plan(example / "spec.yaml", [], spec=spec)
    with pytest.raises(UsageError, match="takes key=value items and --config-dir DIR, not --multirun"):
        own_presets(["-m"])


def test_chat_settings_reach_the_rendered_prompt(checkpoint, tmp_path):
    import jinja2

    from qerl_exp.models.tokenizers import CharTokenizer, HFTokenizer

    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    tok = HFTokenizer(checkpoint, local_files_only=True)
    assert tok.render_prompt(messages, "ignored for messages") == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    tok.use_chat("", {"enable_thinking": False})
    assert tok.render_prompt(messages, "").endswith("<|im_start|>assistant\n<think></think>")
    own = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    tok.use_chat(own, {})
    expected = jinja2.Template(own).render(messages=[{"role": "system", "content": "Be brief."}, *messages], add_generation_prompt=True)
    assert tok.render_prompt("What is 2 + 2?", "Be brief.") == expected == "[system] Be brief.\n[user] What is 2 + 2?\n[assistant] "
    with pytest.raises(ValueError, match="the embedded model has no chat template"):
        CharTokenizer().render_prompt(messages, "")


def test_prompts_render_as_trl_renders_them(checkpoint, tmp_path):
    """A conversation whose last message is the assistant's (a prefill) is continued, not closed; a
    text prompt under `task.text_prompts=verbatim` is the text, after the special tokens the
    tokenizer adds to a text (a BOS), so its ids are the ones TRL's tokenizer call gives."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from trl.data_utils import maybe_apply_chat_template

    from qerl_exp.models.tokenizers import HFTokenizer

    tok = HFTokenizer(checkpoint, local_files_only=True)
    prefill = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "<think>"}]
    rendered = tok.render_prompt(prefill, "ignored")
    assert rendered == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n<think>"
    assert rendered == maybe_apply_chat_template({"prompt": prefill}, tok.tok)["prompt"]
    tok.use_chat("", {}, text_prompts="verbatim")
    assert tok.render_prompt("2 + 2 =", "ignored") == "2 + 2 ="  # this tokenizer adds no special token

    # a tokenizer that puts a BOS before every text, as Llama's do
    vocab = {c: i for i, c in enumerate(["<s>", "</s>", *"0123456789 +=abc"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path / "bos")
    bos = HFTokenizer(tmp_path / "bos", local_files_only=True)
    bos.use_chat("", {}, text_prompts="verbatim")
    assert bos.render_prompt("2 + 2 =", "ignored") == "<s>2 + 2 ="
    assert bos.encode(bos.render_prompt("2 + 2 =", "")) == bos.tok("2 + 2 =")["input_ids"]  # TRL's ids


def test_a_hub_dataset_without_the_hub_fails_in_one_line_within_seconds(monkeypatch):
    from qerl_exp.config import TaskConfig
    from qerl_exp.tasks import build_task

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    with pytest.raises(ValueError) as err:
        build_task(TaskConfig(name="dataset", path="nobody-here/no-such-dataset"))
    assert time.time() - t0 < 10
    assert str(err.value).startswith("task.path=nobody-here/no-such-dataset could not be loaded (the hub is unreachable "
                                     "and it is not in the local datasets cache)")
    assert "\n" not in str(err.value)


def test_malformed_rows_of_your_own_data_are_named(tmp_path):
    from qerl_exp.config import TaskConfig
    from qerl_exp.tasks import build_task

    rows = [{"prompt": "What is 1 + 1?", "answer": 2}, {"prompt": [{"role": "user"}], "answer": "3"},
            {"prompt": "What is 2 + 2?", "answer": None}, {"prompt": "", "answer": "5"}]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(ValueError) as err:
        build_task(TaskConfig(name="dataset", path=str(tmp_path / "data.jsonl")))
    assert str(err.value) == (
        f"{tmp_path / 'data.jsonl'}: 3 malformed lines: line 2: column 'prompt' (the prompt) must be non-empty text or a "
        "list of {role, content} messages with text content, got list; line 3: column 'answer' (the answer) is empty; "
        "line 4: column 'prompt' (the prompt) must be non-empty text or a list of {role, content} messages with text "
        "content, got str")
    (tmp_path / "data.csv").write_text("question,solution,level\nWhat is 1 + 1?,2,a\nWhat is 2 + 3?,5,b\n"
                                       "What is 4 + 4?,8,a\nWhat is 9 - 3?,6,b\n")
    task = build_task(TaskConfig(name="dataset", path=str(tmp_path / "data.csv")))  # question and solution columns
    assert sorted((p.question, p.answer, dict(p.columns)) for p in task.train + task.held_out)[0] == \
        ("What is 1 + 1?", "2", {"solution": 2, "level": "a"})
    assert task.columns == ("answer", "solution", "level") and not task.conversational


def test_held_out_problems_come_from_a_split_or_another_source(example):
    import datasets

    from qerl_exp.config import TaskConfig
    from qerl_exp.tasks import build_task

    rows = datasets.load_dataset("json", data_files=str(example / "data.jsonl"))["train"]
    splits = datasets.DatasetDict({"train": rows.select(range(12)), "test": rows.select(range(10, 16))})
    splits.save_to_disk(str(example / "splits"))
    test = build_task(TaskConfig(name="dataset", path=str(example / "splits"), eval_split="test"))
    # the test split less the two prompts training also has
    assert [p.question for p in test.held_out] == [r["prompt"][-1]["content"] for r in rows.select(range(12, 16))]
    assert len(test.train) == 12
    rows.select(range(12)).to_json(str(example / "train.jsonl"))
    rows.select(range(10, 16)).to_json(str(example / "held.jsonl"))
    other = build_task(TaskConfig(name="dataset", path=str(example / "train.jsonl"), eval_path=str(example / "held.jsonl")))
    assert (other.train, other.held_out) == (test.train, test.held_out)
    with pytest.raises(ValueError, match=r"has the splits train, test; name the one to evaluate on with task.eval_split$"):
        build_task(TaskConfig(name="dataset", path=str(example / "data.jsonl"), eval_path=str(example / "splits")))


def test_completions_no_function_applies_to_are_named_once(tmp_path, capsys):
    from qerl_exp.config import TaskConfig
    from qerl_exp.tasks import Problem
    from qerl_exp.tasks.reward_funcs import load

    (tmp_path / "some.py").write_text("def only_hard(prompts, completions, level, **kwargs):\n"
                                      "    return [1.0 if l == 'hard' else None for l in level]\n")
    rewards = load(TaskConfig(name="dataset", path="x", reward_funcs=[f"{tmp_path}/some.py:only_hard"]), ("answer", "level"))
    problems = [Problem("q", "1", columns={"level": level}) for level in ("hard", "easy", "easy")]
    scores = rewards.compute(problems, ["a", "b", "c"], "step 4")
    assert scores["only_hard"][0] == 1.0 and all(math.isnan(v) for v in scores["only_hard"][1:])
    rewards.compute(problems, ["a", "b", "c"], "step 5")
    assert capsys.readouterr().err == ("warning: no reward function applies to 2 completion(s) at step 4 (each returned "
                                       "None): they get no reward and advantage 0, as in TRL (shown once)\n")


# --------------------------------------------------------------------------- hostile input: what the run will use, checked first


@pytest.mark.parametrize("overrides, message", [
    (["task.chat_template='{% for m in messages %}{{ m.content }'"], "is not a Jinja template Jinja can read (line 1: "),
    (["task.chat_template='{% for m in messages %}{% endfor %}'"],
     "renders the prompt of data.jsonl line 2 as empty text: the model would see none of it; fix the template"),
    (["+task.chat_template_kwargs.add_generation_prompt=false"],
     "task.chat_template_kwargs.add_generation_prompt is an argument of the template's rendering, not a variable of the "
     "template (the harness renders every prompt as text with add_generation_prompt=true); drop it"),
    (["task.chat_template='{{ \"x\" * 600 }}{% for m in messages %}{{ m.content }}{% endfor %}'"],
     "tokens as the chat template renders it with task.system_prompt, data.jsonl line 7) leaves no room in the model's 512 "
     "positions; shorten task.system_prompt (task.system_prompt='' sends none) or task.chat_template"),
    (["task.path=data"], "task.path=data is not a file here, and would be read as a hub dataset id; did you mean "
                         "task.path=data.jsonl?"),
    (["task.columns.answer=prompt"], "task.columns.answer=prompt is the prompt's column of task.path=data.jsonl: every "
                                     "row would be judged against its own question; name the column that holds the answer"),
    (["task.eval_path=held.jsonl", "task.reward_funcs=[hard.py:hard]"],
     "reward function hard (hard.py:hard) needs 'difficulty', which the held-out rows of task.eval_path=held.jsonl lack"),
])
def test_what_a_run_would_fail_on_later_is_refused_before_its_run_dir(example, checkpoint, monkeypatch, overrides,
                                                                       message):
    monkeypatch.chdir(example)
    rows = [json.loads(line) for line in (example / "data.jsonl").read_text().splitlines()]
    (example / "held.jsonl").write_text("".join(json.dumps({"prompt": f"{r['prompt'][-1]['content']} (held)",
                                                            "answer": r["answer"]}) + "\n" for r in rows[:4]))
    (example / "hard.py").write_text("def hard(prompts, completions, difficulty, **kwargs):\n"
                                     "    return [float(d) for d in difficulty]\n")
    with pytest.raises(UsageError) as err:
        validate([f"model.name={checkpoint}", "task=dataset", "task.path=data.jsonl", f"run_dir={example / 'run'}",
                  "algo.max_new_tokens=16", *overrides], multirun=False)
    line = str(err.value).replace(f"{example}/", "")
    assert message in line and "\n" not in line
    assert not (example / "run").exists()


def _helper_folders(tmp_path: Path) -> list[Path]:
    """Two folders, each a reward file that imports its own `helper.py` (a different constant)."""
    folders = []
    for name, value in (("a", 1.0), ("b", 2.0)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "helper.py").write_text(f"VALUE = {value}\n")
        (folder / "rewards.py").write_text(f"import helper\n\n\ndef {name}(prompts, completions, **kwargs):\n"
                                           "    import helper as late  # imported as it runs: its folder's too\n"
                                           "    return [helper.VALUE + 10 * late.VALUE] * len(completions)\n")
        folders.append(folder)
    return folders


def test_reward_files_in_two_folders_each_import_their_own_neighbours(tmp_path):
    from qerl_exp.config import TaskConfig
    from qerl_exp.tasks import Problem, source_files
    from qerl_exp.tasks.reward_funcs import load

    a, b = _helper_folders(tmp_path)
    cfg = TaskConfig(name="dataset", path="x", reward_funcs=[f"{a}/rewards.py:a", f"{b}/rewards.py:b"])
    scores = load(cfg, ("answer",)).compute([Problem("q", "1")] * 2, ["x", "y"], "step 0")
    assert scores == {"a": [11.0, 11.0], "b": [22.0, 22.0]}
    assert [entry["imports"] for entry in source_files(cfg).values()] == [{"helper.py": sha16(a / "helper.py")},
                                                                          {"helper.py": sha16(b / "helper.py")}]


def test_a_neighbour_edited_under_a_run_is_a_change_of_its_reward_code(tmp_path):
    from qerl_exp.run import record
    from qerl_exp.config.compose import compose
    from qerl_exp.run.run_files import comparable, digests

    a, _ = _helper_folders(tmp_path)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(8)))
    cfg = compose(["task=dataset", f"task.path={tmp_path / 'data.jsonl'}", f"task.reward_funcs=[{a}/rewards.py:a]"])[0]
    started = digests(cfg)
    entry = started[record.REWARDS_KEY]["a"]
    assert entry == {"file": str(a / "rewards.py"), "sha256": sha16(a / "rewards.py"),
                     "imports": {"helper.py": sha16(a / "helper.py")}}
    (a / "helper.py").write_text("VALUE = 5.0\n")
    now = digests(cfg)
    assert now[record.REWARDS_KEY]["a"]["imports"] != entry["imports"] and now[record.REWARDS_KEY]["a"]["sha256"] == entry["sha256"]
    # a record made before imports were followed compares on the file alone, under its path as typed
    older = {**as_dict_of(cfg), record.REWARDS_KEY: {"a": {"file": str(a / "rewards.py"), "sha256": entry["sha256"]}}}
    assert comparable(older, now)[record.REWARDS_KEY] == older[record.REWARDS_KEY]


def as_dict_of(cfg):
    from qerl_exp.config import as_dict

    return as_dict(cfg)


def test_user_code_that_exits_is_an_error_and_its_top_level_sees_no_harness_arguments(tmp_path, monkeypatch):
    from qerl_exp.config import ConfigError, TaskConfig
    from qerl_exp.tasks import Problem
    from qerl_exp.tasks.reward_funcs import RewardError, load

    monkeypatch.setattr(sys, "argv", ["python -m qerl_exp", "train.steps=2", "task=dataset"])
    (tmp_path / "quits.py").write_text("import sys\n\n\ndef quits(prompts, completions, **kwargs):\n    sys.exit(0)\n")
    rewards = load(TaskConfig(name="dataset", path="x", reward_funcs=[f"{tmp_path}/quits.py:quits"]), ("answer",))
    with pytest.raises(RewardError) as err:
        rewards.compute([Problem("q", "1")], ["x"], "step 3")
    assert str(err.value) == (f"reward function quits ({tmp_path}/quits.py:quits) ended the program at step 3: "
                              "SystemExit(0): it called sys.exit (or a library did for it); raise an exception instead")
    script = ("import argparse\nparser = argparse.ArgumentParser()\nparser.add_argument('--scale', type=float, {})\n"
              "ARGS = parser.parse_args()\n\n\ndef scaled(prompts, completions, **kwargs):\n"
              "    return [ARGS.scale] * len(completions)\n")
    (tmp_path / "script.py").write_text(script.format("default=3.0"))
    rewards = load(TaskConfig(name="dataset", path="x", reward_funcs=[f"{tmp_path}/script.py:scaled"]), ("answer",))
    assert rewards.compute([Problem("q", "1")], ["x"], "step 0") == {"scaled": [3.0]}
    assert sys.argv == ["python -m qerl_exp", "train.steps=2", "task=dataset"]
    (tmp_path / "needs.py").write_text(script.format("required=True"))
    with pytest.raises(ConfigError) as err:
        load(TaskConfig(name="dataset", path="x", reward_funcs=[f"{tmp_path}/needs.py:scaled"]), ("answer",))
    assert str(err.value) == (
        f"task.reward_funcs entry {tmp_path}/needs.py:scaled: importing {tmp_path}/needs.py ends the program "
        "(SystemExit(2): it called sys.exit (or a library did for it); it printed: needs.py: error: the following "
        "arguments are required: --scale); keep a script's own argument parsing and exits under if __name__ == '__main__':")


@pytest.mark.parametrize("returned, weights, message", [
    ("[1e39] * len(completions)", [1.0], "returned 1e+39 for completion 0 at step 2, beyond float32's range (+-3.4e+38)"),
    ("[3e38] * len(completions)", [2.0], "the weighted rewards of completion 0 at step 2 (2 x 3e+38) sum beyond float32's "
                                         "range (+-3.4e+38)"),
])
def test_rewards_are_checked_in_float32_which_sums_them(tmp_path, returned, weights, message):
    from qerl_exp.config import TaskConfig
    from qerl_exp.tasks import Problem
    from qerl_exp.tasks.reward_funcs import RewardError, load

    (tmp_path / "big.py").write_text(f"def big(prompts, completions, **kwargs):\n    return {returned}\n")
    rewards = load(TaskConfig(name="dataset", path="x", reward_funcs=[f"{tmp_path}/big.py:big"], reward_weights=weights),
                   ("answer",))
    with pytest.raises(RewardError) as err:
        rewards.compute([Problem("q", "1")] * 2, ["a", "b"], "step 2")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_python_repr_or_a_latin1_byte_in_a_jsonl_is_named_by_file_and_line(tmp_path):
    from qerl_exp.config import TaskConfig
    from qerl_exp.tasks import build_task

    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
    (tmp_path / "repr.jsonl").write_text("".join(f"{r}\n" for r in rows))  # str(row), not json.dumps(row)
    with pytest.raises(ValueError) as err:
        build_task(TaskConfig(name="dataset", path=str(tmp_path / "repr.jsonl")))
    assert str(err.value).startswith(
        f"{tmp_path / 'repr.jsonl'}: 6 malformed lines: line 1: not valid JSON (Expecting property name enclosed in "
        "double quotes at column 2); it is a Python dict (str(row)), not JSON: write each row with json.dumps(row); line 2:")
    lines = [json.dumps(r).encode() for r in rows]
    lines[3] = lines[3].replace(b"What", b"Qu\xe9")  # a Latin-1 byte
    (tmp_path / "latin.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(ValueError) as err:
        build_task(TaskConfig(name="dataset", path=str(tmp_path / "latin.jsonl")))
    assert str(err.value) == (f"{tmp_path / 'latin.jsonl'}: 1 malformed line: line 4: not UTF-8 text (byte 0xe9 at "
                              "column 15); save the file as UTF-8 (JSON text is)")


def test_the_data_of_a_save_to_disk_folder_is_digested_not_the_caches_datasets_writes_beside_it(example):
    import datasets

    from qerl_exp.tasks import reader

    rows = datasets.load_dataset("json", data_files=str(example / "data.jsonl"))["train"]
    rows.save_to_disk(str(example / "saved"))
    before = reader.digest(str(example / "saved"))
    loaded = datasets.load_from_disk(str(example / "saved"))
    loaded.map(lambda row: {"n": len(row["answer"])})  # as in a notebook: its cache file goes into the folder
    assert list((example / "saved").glob("cache-*.arrow"))
    assert reader.digest(str(example / "saved")) == before
    assert reader.digest(str(example / "saved"), caches=True) != before  # what records made before counted
    loaded.filter(lambda row: True).save_to_disk(str(example / "other"))
    (example / "saved" / "data-00000-of-00001.arrow").write_bytes((example / "other" / "data-00000-of-00001.arrow").read_bytes()[:-8])
    assert reader.digest(str(example / "saved")) != before  # the data itself changed
@pytest.mark.slow
def test_a_config_dir_presets_values_are_what_the_run_records_and_cfg_job_prints(example, checkpoint):
    """A preset of a folder of your own that tunes the learning rate and the completion length, run on
    a checkpoint named by `model.name`: the run records (and uses) the preset's values, `--cfg job`
    prints what `config.json` records, and W&B's tags name the checkpoint."""
    (example / "myconf" / "task" / "short.yaml").write_text(
        "# @package _global_\n# a task preset that also tunes the run\ntrain:\n  lr: 2e-3\nalgo:\n  max_new_tokens: 32\n")
    args = ["--config-dir", "myconf", "task=short", f"model.name={checkpoint}", "train.steps=1",
            "train.prompts_per_step=2", "algo.group_size=2", "run_dir=run"]
    shown = command(example, *args, "--cfg", "job")
    assert shown.returncode == 0, shown.stderr[-2000:]
    out = command(example, *args, env_extra={"WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads((example / "run" / "config.json").read_text())
    assert (config["train"]["lr"], config["algo"]["max_new_tokens"]) == (2e-3, 32)
    assert config["choices"]["model"] == "checkpoint"
    from qerl_exp.config import flatten

    printed, recorded = flatten(yaml.safe_load(shown.stdout)), flatten(config)
    # null is "follow another setting" (algo.eps_high: algo.eps_low), which config.json records resolved
    assert {k: v for k, v in printed.items() if v is not None and recorded[k] != v} == {}
    assert printed["algo.eps_high"] is None and recorded["algo.eps_high"] == recorded["algo.eps_low"]
    leet = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json",
                           str(next((example / "run").glob("wandb/latest-run/run-*.wandb")))],
                          capture_output=True, text=True, timeout=120)
    assert f"model:{checkpoint.name}" in json.loads(leet.stdout)["tags"], leet.stdout[-2000:]
