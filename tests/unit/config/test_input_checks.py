"""Every bad value refused before anything runs, in one line that names it: non-finite and
out-of-range numbers in every command, task data checked whole (file and line), answers parsed in
bounded time, requests beyond the model's positions, broken checkpoint folders, command lines
Hydra's parser would answer with its usage text, storage URLs, and advice in each command's keys."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import typing

import pytest

from conftest import ROOT, SUBPROCESS_ENV, tiny_checkpoint
from qerl_exp.cli import split_command_line, validate
from qerl_exp.config import Config
from qerl_exp.run.console import UsageError

def _float_keys(cls: type = Config, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            keys += _float_keys(hint, f"{prefix}{f.name}.")
        elif hint in (float, float | None):
            keys.append(f"{prefix}{f.name}")
    return keys


def _one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


@pytest.mark.parametrize("key, value", [(k, ("nan", "inf", "-inf")[i % 3]) for i, k in enumerate(_float_keys())])
def test_every_float_option_must_be_finite(key, value):
    with pytest.raises(UsageError) as e:
        validate([f"{key}={value}"], multirun=False)
    assert _one_line(e) == f"{key} must be a finite number, got {float(value)}"


@pytest.mark.parametrize("args, message", [
    (["lora.alpha=-3"], "lora.alpha must be > 0"),
    (["algo.entropy_coef=-0.1"], "algo.entropy_coef must be >= 0"),
    (["train.weight_decay=-1"], "train.weight_decay must be >= 0"),
    (["model.num_kv_heads=0"], "model.num_kv_heads must be >= 1, got 0"),
    (["model.warmup.batch_size=0"], "model.warmup.batch_size and model.warmup.eval_every >= 1"),
    (["noise.gain=-1"], "noise.gain and noise.target_value must be >= 0"),
    (["model.vocab_size=10"], "model.vocab_size=10 is below the embedded tokenizer's"),
    (["model.cache_dir="], "model.cache_dir must name a folder"),
    (["quant=nvfp4", "quant.targets=[]"], "quant.targets must name at least one linear for quant.format=nvfp4"),
    (["lora.targets=[foo]"], "lora.targets entry 'foo' names no module of this qwen2 model (its linear layers: "),
    (["train.optimizer=sgd"], "train.optimizer='sgd' is not valid; choose one of: adamw_torch, adamw_8bit"),
    (["train.lr_scheduler=cosine_min"], "train.lr_scheduler='cosine_min' is not valid; choose one of: warmup_cosine, "),
    (["train.lr_scheduler=warmup_stable_decay"], "train.lr_scheduler=warmup_stable_decay with train.lr_scheduler_kwargs={}: "
                                                 "get_wsd_schedule() missing 1 required positional argument: 'num_decay_steps'; "
                                                 "give the schedule's arguments in train.lr_scheduler_kwargs"),
    (["learning_rate=1e-5"], "unknown config key 'learning_rate'; did you mean train.lr (TRL's learning_rate)? "
                             "(docs/trl.md maps TRL's names)"),
    (["algo.num_generations=4"], "unknown config key 'algo.num_generations'; did you mean algo.group_size (TRL's "
                                 "num_generations)?"),
    (["+algo.epsilon_high=0.28"], "did you mean algo.eps_high (TRL's epsilon_high: null follows algo.eps_low)?"),
    (["task=wordprob"], "leaves no room in the model's 256 positions; raise model.max_positions"),
    (["algo.max_new_tokens=300"], "algo.max_new_tokens=300 and the task's longest prompt ("),
    (["eval.max_new_tokens=251"], "lower eval.max_new_tokens to at most 249 or raise model.max_positions"),
])
def test_out_of_range_values_are_refused_before_the_run(args, message):
    with pytest.raises(UsageError) as e:
        validate(args, multirun=False)
    assert message in _one_line(e)


def test_eval_settings_are_finite_and_its_advice_names_its_own_keys(monkeypatch):
    from qerl_exp.eval.__main__ import parse_args

    for arg, message in (("temperature=inf", "temperature must be a finite number, got inf"),
                         ("top_p=nan", "top_p must be a finite number, got nan"),
                         ("seed=-1", "seed must be an integer in 0..4294967295, got -1"),
                         ("k=nan", "bad value for 'k': 'nan' is not an int")):
        with pytest.raises(UsageError) as e:
            parse_args(["run_dir=R", arg])
        assert _one_line(e) == message
    from qerl_exp.models import resolve_device

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match="^device=cuda but no CUDA device is visible; use device=cpu or auto$"):
        resolve_device("cuda", key="device")


def test_sweep_spec_numbers_must_be_finite(tmp_path):
    import yaml

    from qerl_exp.sweep.spec import load_plan

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"params": {"noise.sigma": {"type": "float", "low": 1e-4, "high": float("inf")}},
                                    "objective": {"metric": "reward"}, "n_trials": 1}))
    with pytest.raises(UsageError) as e:
        load_plan(spec, [], check_config=False)
    assert _one_line(e) == f"{spec}: params.noise.sigma: inf is not a finite number"
    for fields, argv, message in (({"seeds": [-1]}, [], "seeds must be integers in 0..4294967295, got [-1]"),
                                  ({"base": ["run_dir=/tmp/x"]}, [], "run_dir=/tmp/x: a sweep gives each trial its own"),
                                  ({}, ["resume=/tmp/x"], "resume=/tmp/x: a sweep gives each trial its own")):
        spec.write_text(yaml.safe_dump({"params": {"noise.sigma": {"type": "float", "low": 1e-4, "high": 1e-2}},
                                        "objective": {"metric": "reward"}, "n_trials": 1, **fields}))
        with pytest.raises(UsageError) as e:
            load_plan(spec, argv, check_config=False)
        assert message in _one_line(e)


@pytest.mark.slow
def test_a_sweep_dir_in_a_run_or_holding_runs_is_refused(tmp_path, capsys):
    from qerl_exp.run import rundir
    from qerl_exp.config import as_dict
    from qerl_exp.sweep.__main__ import main

    rundir.claim(tmp_path / "run", {**as_dict(Config()), "choices": {}}).release()
    for sweep_dir, message in ((tmp_path / "run" / "sweep", f"is in the run directory {tmp_path / 'run'}"),
                               (tmp_path, f"holds other runs (e.g. {tmp_path / 'run'})")):
        with pytest.raises(SystemExit):
            main([str(ROOT / "sweeps" / "noise_schedule.yaml"), f"sweep_dir={sweep_dir}", "n_trials=1"])
        assert capsys.readouterr().err.strip().splitlines() == [
            f"error: sweep_dir={sweep_dir} {message}; give the sweep a folder of its own"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and not (tmp_path / "run" / "sweep").exists()


# --------------------------------------------------------------------------- task data


def test_task_data_is_checked_whole_with_file_and_line_before_the_run(tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [{"question": f"What is {i}+{i}?", "answer": f"#### {2 * i}"} for i in range(8)]
    rows[5]["question"] = "Was kostet ein Café?"  # a character the embedded tokenizer lacks
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UsageError) as e:
        validate(["task=gsm8k", f"task.path={data}"], multirun=False)
    assert _one_line(e).startswith(f"{data} line 6: character 'é' is not in the embedded tokenizer's vocabulary; "
                                   "remove or rewrite that problem")
    rows[5] = {"question": "What is 5+5?", "answer": "#### 1e999999999"}  # an exact value of a billion digits
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    start = time.monotonic()
    with pytest.raises(UsageError) as e:
        validate(["task=gsm8k", f"task.path={data}"], multirun=False)
    assert time.monotonic() - start < 30
    assert f"{data}: 1 malformed line: line 6: final answer '1e999999999' after '####' is not a number" in _one_line(e)
    data.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(UsageError) as e:
        validate(["task=gsm8k", f"task.path={data}"], multirun=False)
    assert _one_line(e).startswith(f"task.path={data} holds 1 distinct problem, too few to hold any out")


@pytest.mark.parametrize("text", ["5 " + "a" * 60 + "1", "-" + " " * 20000 + "x", "5" + "." * 20000 + "x", "1e999999999",
                                  "\\frac{1e99999999}{2}", "1" * 100000])
def test_any_answer_parses_in_bounded_time(text):
    from qerl_exp.tasks.answer import answers_equal, parse_number

    start = time.monotonic()
    assert parse_number(text) is None and not answers_equal(text, "15")
    assert time.monotonic() - start < 1.0


# --------------------------------------------------------------------------- checkpoint folders


def test_a_checkpoint_folder_without_tokenizer_or_with_truncated_weights_is_named(tmp_path):
    folder = tiny_checkpoint(tmp_path / "model")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(UsageError) as e:
        validate([f"model.name={folder}"], multirun=False)
    assert _one_line(e).startswith(f"model.name={folder}: model.safetensors is not a readable safetensors file (")
    weights.write_bytes(data)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(UsageError) as e:
        validate([f"model.name={folder}"], multirun=False)
    assert _one_line(e).startswith(f"model.name={folder} holds no tokenizer (")


# --------------------------------------------------------------------------- command lines and URLs


def test_options_and_overrides_are_split_whatever_their_order():
    assert split_command_line(["train.steps=2", "-m", "seed=0,1"]) == (["-m"], ["train.steps=2", "seed=0,1"])
    assert split_command_line(["quant=nf4", "--cfg", "job", "seed=1"]) == (["--cfg", "job"], ["quant=nf4", "seed=1"])
    assert split_command_line(["--info", "seed=1"]) == (["--info"], ["seed=1"])
    for args, message in ((["-c", "nope"], "argument --cfg/-c: invalid choice: 'nope'"),
                          (["--bogus"], "unrecognized arguments: --bogus"),
                          (["--config-name=x"], "--config-name and --config-path are not taken")):
        with pytest.raises(UsageError) as e:
            split_command_line(args)
        assert _one_line(e).startswith(message)
    with pytest.raises(UsageError) as e:
        validate(["run_dir=/tmp/a=b"], multirun=False)
    assert _one_line(e).startswith("cannot parse the override 'run_dir=/tmp/a=b' (")


def test_sqlite_paths_expand_the_home_folder_and_refuse_unexpanded_variables(monkeypatch, tmp_path):
    from qerl_exp.sweep.spec import load_plan
    from qerl_exp.sweep.storage import expand_sqlite, storage_url

    monkeypatch.setenv("HOME", str(tmp_path))
    assert expand_sqlite("sqlite:///~/study.db") == f"sqlite:///{tmp_path}/study.db"
    assert expand_sqlite("postgresql://u@h/db") == "postgresql://u@h/db"
    plan = load_plan(ROOT / "sweeps" / "noise_schedule.yaml", ["storage=sqlite:///~/s/study.db"], check_config=False)
    assert storage_url(plan) == f"sqlite:///{tmp_path}/s/study.db"
    with pytest.raises(UsageError, match=r"its path holds '\$', a variable the shell did not expand"):
        expand_sqlite("sqlite:///$HOME/study.db")


# --------------------------------------------------------------------------- each command, end to end


@pytest.mark.slow
@pytest.mark.parametrize("command, args, code, line", [
    ("qerl_exp", ["task.correct_reward=nan"], 2, "error: task.correct_reward must be a finite number, got nan"),
    ("qerl_exp", ["train.steps=2", "-m", "algo.beta=0,inf"], 2, "error: algo.beta must be a finite number, got inf"),
    ("qerl_exp.eval", ["run_dir=R", "device=cuda"], 2,
     "error: device=cuda needs a CUDA device and none is visible; use device=cpu (or auto)"),
    ("qerl_exp.sweep", ["sweeps/noise_schedule.yaml", "storage=sqlite:///$HOME/x.db"], 2,
     "error: storage=sqlite:///$HOME/x.db: its path holds '$', a variable the shell did not expand (it was quoted); "
     "write the path out"),
])
def test_each_command_refuses_in_one_line(command, args, code, line):
    import subprocess

    out = subprocess.run([sys.executable, "-m", command, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**SUBPROCESS_ENV, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == code and out.stderr.strip().splitlines() == [line], out.stderr[-2000:]


def test_a_run_whose_data_file_is_gone_is_named_by_resume_and_eval(tmp_path):
    import shutil

    from qerl_exp.config.compose import compose
    from qerl_exp.eval.__main__ import run_config as eval_config
    from qerl_exp.train import run_config

    data = tmp_path / "gsm8k.jsonl"
    shutil.copy(ROOT / "tests" / "data" / "gsm8k_sample.jsonl", data)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(run_config(*compose(["task=gsm8k", f"task.path={data}"]))))
    data.unlink()
    with pytest.raises(UsageError) as e:
        validate([f"resume={run_dir}"], multirun=False)
    assert _one_line(e) == f"task.path={data}, the run's data, does not exist; restore that file"
    with pytest.raises(ValueError, match=f"^task.path={data}, the run's data, does not exist: its held-out split"):
        eval_config(run_dir)


def test_paths_typed_with_a_tilde_after_an_equals_sign_are_expanded(monkeypatch, tmp_path):
    from qerl_exp.eval.__main__ import parse_args
    from qerl_exp.run.files import user_path
    from qerl_exp.sweep.spec import load_plan

    monkeypatch.setenv("HOME", str(tmp_path))
    assert Config(run_dir="~/runs/a", resume="~/runs/a").run_dir == f"{tmp_path}/runs/a"  # sh and zsh pass ~ as typed
    assert parse_args(["run_dir=~/runs/a", "out=~/e.json"]).run_dir == f"{tmp_path}/runs/a"
    assert user_path("~/report") == tmp_path / "report"
    plan = load_plan(ROOT / "sweeps" / "noise_schedule.yaml", ["sweep_dir=~/sweep"], check_config=False)
    assert plan.sweep_dir == tmp_path / "sweep"


def test_ctrl_c_while_the_command_starts_is_one_line():
    import signal
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "qerl_exp", "train.steps=1"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=SUBPROCESS_ENV,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(0.5)  # in the imports and the validation, seconds before a run starts
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip().splitlines() == [
        "error: interrupted before the run started; nothing was written"], err[-2000:]


def test_a_preset_of_your_own_named_like_a_built_in_one_is_refused(tmp_path):
    from qerl_exp.cli import parse_command_line

    (tmp_path / "mine" / "algo").mkdir(parents=True)
    (tmp_path / "mine" / "algo" / "grpo.yaml").write_text((ROOT / "conf" / "algo" / "grpo.yaml").read_text().replace(
        "group_size: 8", "group_size: 3"))
    with pytest.raises(UsageError) as e:
        validate(parse_command_line(["--config-dir", str(tmp_path / "mine"), "algo=grpo"])[0], multirun=False)
    assert _one_line(e) == (
        f"{tmp_path}/mine/algo/grpo.yaml is named like the built-in preset algo=grpo ({ROOT}/conf/algo/grpo.yaml), which "
        "Hydra's search path finds first, so yours would never be used; rename it (e.g. algo/grpo_mine.yaml) and choose "
        "it by that name")
    (tmp_path / "mine" / "algo" / "grpo.yaml").rename(tmp_path / "mine" / "algo" / "grpo_mine.yaml")
    cfg = validate(parse_command_line(["--config-dir", str(tmp_path / "mine"), "algo=grpo_mine"])[0], multirun=False)[0]
    assert cfg.algo.group_size == 3


def test_a_yaml_slip_in_a_preset_names_its_file_and_line(tmp_path):
    from qerl_exp.cli import parse_command_line

    (tmp_path / "mine" / "task").mkdir(parents=True)
    (tmp_path / "mine" / "task" / "typo.yaml").write_text("defaults:\n  - arith\n  - _self_\n\ndifficulty: 3\n  ops: [+]\n")
    with pytest.raises(UsageError) as e:
        validate(parse_command_line(["--config-dir", str(tmp_path / "mine"), "task=typo"])[0], multirun=False)
    assert _one_line(e) == (f"{tmp_path}/mine/task/typo.yaml, line 6, column 6: mapping values are not allowed here "
                            "(YAML cannot read it); fix that line")


def test_a_save_to_disk_folder_whose_caches_datasets_wrote_later_is_still_the_runs_data(tmp_path):
    import datasets

    from qerl_exp.run import record
    from qerl_exp.config.compose import compose
    from qerl_exp.eval.__main__ import run_config as eval_config
    from qerl_exp.tasks import reader
    from qerl_exp.train import run_config

    rows = datasets.load_dataset("json", data_files=str(ROOT / "tests" / "data" / "gsm8k_sample.jsonl"))["train"]
    rows.save_to_disk(str(tmp_path / "gsm8k"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    started = run_config(*compose(["task=gsm8k", f"task.path={tmp_path / 'gsm8k'}"]))
    (run_dir / "config.json").write_text(json.dumps(started))
    datasets.load_from_disk(str(tmp_path / "gsm8k")).map(lambda row: {"n": len(row["answer"])})  # a notebook's .map
    assert list((tmp_path / "gsm8k").glob("cache-*.arrow"))
    validate([f"resume={run_dir}"], multirun=False)  # neither resume nor eval refuses it
    assert eval_config(run_dir).task.path == str(tmp_path / "gsm8k")
    # a record made when the digest counted every file of the folder, a cache among them, compares too
    older = {**started, record.DATA_KEY: {"path": reader.digest(str(tmp_path / "gsm8k"), caches=True)}}
    (run_dir / "config.json").write_text(json.dumps(older))
    assert eval_config(run_dir).task.path == str(tmp_path / "gsm8k")
    validate([f"resume={run_dir}"], multirun=False)
