"""Run directories and their records: one claim per run, default names never another run's, a
run_dir holding other runs refused, a base swapped under a run refused, and records written by an
older schema still resumable (fields they lack take the values the run used)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY_RUN, metrics_rows, save_checkpoint, tiny_checkpoint, tiny_qwen2
from qerl_exp.cli import Refused, validate
from qerl_exp.config import Config, as_dict, from_dict, history
from qerl_exp.config.compose import compose
from qerl_exp.run import record, rundir


def _one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def _log_a_step(run_dir: Path) -> None:
    """What a run that has begun holds: a logged step (a claim alone is a run that never started)."""
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')


def _record(**groups) -> dict:
    config = as_dict(Config())
    for group, values in groups.items():
        config[group].update(values)
    return {**config, "choices": {}}


# --------------------------------------------------------------------------- claims and names


def test_a_default_name_in_use_is_passed_over_and_a_named_one_is_refused(tmp_path):
    name = tmp_path / "runs" / "12-00-00_bf16_none_s0"
    first = rundir.claim(name, _record(), fresh=True)
    second = rundir.claim(name, _record(lora={"r": 8}), fresh=True)  # started in the same second, other settings
    third = rundir.claim(name, _record(), fresh=True)  # or the same ones: each run its own directory
    assert [first.path, second.path, third.path] == [name, name.with_name(name.name + "-2"), name.with_name(name.name + "-3")]
    assert json.loads((second.path / "config.json").read_text())["lora"]["r"] == 8
    for owned in (first, second, third):
        owned.release()
    _log_a_step(name)
    with pytest.raises(rundir.ConfigChangedError):  # a name the user gave is that run's, or refused
        rundir.claim(name, _record(lora={"r": 8}))


def test_a_run_that_failed_before_its_first_step_leaves_its_directory_to_the_fixed_command(tmp_path):
    from qerl_exp import train
    from qerl_exp.tasks.reward_funcs import RewardError

    rewards = tmp_path / "rewards.py"
    rewards.write_text("def fmt(completions, **kwargs):\n    return [1.0] * (len(completions) + 1)\n")  # one too many
    overrides = [*TINY_RUN, "train.steps=2", "monitor.every=0", f"task.reward_funcs=[{rewards}:fmt]",
                 f"run_dir={tmp_path / 'run'}"]
    cfg, choices = compose(overrides)
    with pytest.raises(RewardError, match="returned 9 values for 8 completions at step 0"):
        train.run(cfg, tmp_path / "run", choices=choices)
    assert not rundir.started(tmp_path / "run")
    rewards.write_text("def fmt(completions, **kwargs):\n    return [1.0] * len(completions)\n")  # fixed
    validate(overrides, multirun=False)  # the same command takes the directory over
    cfg, choices = compose(overrides)
    assert train.run(cfg, tmp_path / "run", choices=choices)["steps"] == 2
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded[record.REWARDS_KEY]["fmt"]["sha256"] == train.run_config(cfg, choices)[record.REWARDS_KEY]["fmt"]["sha256"]
    assert rundir.started(tmp_path / "run")


def test_checks_of_one_directory_at_once_pass_and_a_running_owner_refuses_them(tmp_path):
    # the ranks of one torchrun command check the run_dir at the same moment: neither may refuse the other
    run_dir = tmp_path / "run"
    rundir.claim(run_dir, _record()).release()  # an unfinished run, to be continued
    another_rank = rundir._lock(run_dir, create=False, shared=True)
    rundir.check(run_dir, _record())
    another_rank.close()
    with rundir.claim(run_dir, _record()):
        with pytest.raises(rundir.RunDirBusy, match=f"in use by process {os.getpid()}"):
            rundir.check(run_dir, _record())


def test_a_run_dir_holding_other_runs_or_a_model_is_refused_and_left_as_it_is(tmp_path):
    for run in ("a", "2026-11-30/b"):
        rundir.claim(tmp_path / "runs" / run, _record()).release()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(rundir.RunDirError) as e:
        rundir.claim(tmp_path / "runs", _record())
    assert _one_line(e).startswith(f"run_dir={tmp_path / 'runs'} holds other runs (e.g. {tmp_path / 'runs'}/")
    assert f"e.g. run_dir={tmp_path / 'runs' / 'new'}" in _one_line(e)
    with pytest.raises(Refused, match="holds other runs"):  # and before anything starts
        validate([f"run_dir={tmp_path / 'runs'}"], multirun=False)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(rundir.RunDirError, match="config.json is not a run's record"):
        rundir.claim(tmp_path / "model", _record())
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "model" not in p.parts) == before


def test_one_directory_for_several_jobs_is_refused_before_the_first(tmp_path):
    with pytest.raises(Exception) as e:
        validate(["seed=0,1", f"run_dir={tmp_path / 'one'}"], multirun=True)
    assert _one_line(e).startswith(f"run_dir={tmp_path / 'one'} names one directory for 2 jobs of the multirun")
    assert not (tmp_path / "one").exists()


# --------------------------------------------------------------------------- the base's identity


def test_a_file_digest_is_computed_once_and_again_when_the_file_changes(tmp_path):
    from qerl_exp.models.digest import file_digest

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 1000)
    real = file_digest(weights, tmp_path / "cache")
    cache = json.loads((tmp_path / "cache" / "digests.json").read_text())
    cache[str(weights)]["sha256"] = "cached"  # what a second call reads while size and mtime hold
    (tmp_path / "cache" / "digests.json").write_text(json.dumps(cache))
    assert file_digest(weights, tmp_path / "cache") == "cached"
    weights.write_bytes(b"y" * 1000)  # same size, new content and mtime
    os.utime(weights, ns=(1, 1))
    assert file_digest(weights, tmp_path / "cache") not in (real, "cached")


def test_a_run_refuses_to_continue_on_another_base(tmp_path):
    from qerl_exp.train import run_config

    folder = tiny_checkpoint(tmp_path / "model")
    cfg, choices = compose([f"model.name={folder}", f"model.cache_dir={tmp_path / 'cache'}"])
    started = run_config(cfg, choices)
    assert len(started[record.BASE_KEY]) == 16
    run_dir = tmp_path / "run"
    rundir.claim(run_dir, started).release()
    _log_a_step(run_dir)
    rundir.claim(run_dir, run_config(cfg, choices)).release()  # the same files: continued
    tiny_qwen2(1, vocab=128, max_positions=512).save_pretrained(folder)  # the weights replaced under the run
    saved = (run_dir / "config.json").read_bytes()
    with pytest.raises(rundir.ConfigChangedError) as e:
        rundir.claim(run_dir, run_config(cfg, choices))
    assert f"(base_sha256: '{started[record.BASE_KEY]}' -> '" in _one_line(e)
    assert "the base model's files (model.name, model.gguf_file) changed since the run started" in _one_line(e)
    with pytest.raises(Refused, match="base_sha256"):  # and refused before anything starts
        validate([f"model.name={folder}", f"model.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}"], multirun=False)
    assert (run_dir / "config.json").read_bytes() == saved


def test_a_checkpoints_chat_template_is_part_of_its_base(tmp_path):
    from qerl_exp.models.pretrained import base_digest
    from qerl_exp.train import run_config

    folder = save_checkpoint(tmp_path / "model")
    template = folder / "chat_template.jinja"
    own = [f"model.name={folder}", f"model.cache_dir={tmp_path / 'cache'}", "algo.max_new_tokens=64"]
    assert template.is_file()  # where transformers saves a tokenizer's chat template
    cfg, choices = compose(own)
    started = run_config(cfg, choices)
    run_dir = tmp_path / "run"
    rundir.claim(run_dir, started).release()
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')  # it trained: a rerun continues it
    template.write_text(template.read_text().replace("<|im_start|>assistant", "<|im_start|>model"))
    saved = (run_dir / "config.json").read_bytes()
    with pytest.raises(rundir.ConfigChangedError) as e:
        rundir.claim(run_dir, run_config(cfg, choices, json.loads(saved)))
    assert f"(base_sha256: '{started[record.BASE_KEY]}' -> '" in _one_line(e)
    with pytest.raises(Refused, match="base_sha256"):
        validate([*own, f"run_dir={run_dir}"], multirun=False)
    assert (run_dir / "config.json").read_bytes() == saved
    # a record made when the base's digest left its templates out continues (compared as it was made)
    older = {**json.loads(saved), record.BASE_KEY: base_digest(cfg.model, templates=False)}
    (run_dir / "config.json").write_text(json.dumps(older))
    validate([*own, f"run_dir={run_dir}"], multirun=False)
    rundir.claim(run_dir, run_config(cfg, choices, older)).release()
    assert json.loads((run_dir / "config.json").read_text()) == older


def test_a_record_of_paths_as_typed_continues_from_its_folder_and_records_them_resolved(tmp_path, monkeypatch):
    from qerl_exp.train import run_config

    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / "tests" / "data" / "gsm8k_sample.jsonl", tmp_path / "data.jsonl")
    (tmp_path / "rewards.py").write_text("def fmt(prompts, completions, **kwargs):\n    return [0.0] * len(completions)\n")
    overrides = ["task=gsm8k", "task.path=data.jsonl", "task.reward_funcs=[rewards.py:fmt]"]
    cfg, choices = compose(overrides)
    record_now = run_config(cfg, choices)
    assert (record_now["task"]["path"], record_now["task"]["reward_funcs"]) == (f"{tmp_path}/data.jsonl",
                                                                                [f"{tmp_path}/rewards.py:fmt"])
    assert record_now[record.REWARDS_KEY]["fmt"]["file"] == f"{tmp_path}/rewards.py"
    older = json.loads(json.dumps(record_now))  # as a version that recorded paths as typed wrote it
    older["task"].update(path="data.jsonl", reward_funcs=["rewards.py:fmt"])
    older[record.REWARDS_KEY]["fmt"]["file"] = "rewards.py"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(older))
    validate([*overrides, "run_dir=run"], multirun=False)  # the same run, continued from its folder
    validate(["resume=run"], multirun=False)
    rundir.claim(run_dir, run_config(cfg, choices, older)).release()
    assert json.loads((run_dir / "config.json").read_text())["task"]["path"] == f"{tmp_path}/data.jsonl"


def test_a_gguf_file_is_identified_by_its_content(tmp_path):
    from qerl_exp.config import ModelConfig
    from qerl_exp.models.pretrained import base_digest

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    cfg = ModelConfig(name="m", gguf_file=str(gguf), cache_dir=str(tmp_path / "cache"))
    before = base_digest(cfg)
    gguf.write_bytes(b"GGUF" + b"\1" * 64)
    assert before and base_digest(cfg) != before
    assert base_digest(ModelConfig()) is None  # the embedded model: its config names it


# --------------------------------------------------------------------------- records of an older schema


def test_a_record_without_a_field_the_schema_gained_reads_as_the_run_used_it(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    config = _record()
    del config["train"]["fused_ops"]  # as a version before the field wrote it
    rundir.claim(run_dir, config).release()
    _log_a_step(run_dir)
    rundir.claim(run_dir, _record()).release()  # a rerun with today's default: the same run
    assert json.loads((run_dir / "config.json").read_text())["train"]["fused_ops"] is True
    (run_dir / "config.json").write_text(json.dumps(config))
    assert from_dict(rundir.resumed(run_dir, config, _record(), set())).train.fused_ops is True
    # a field whose default is not what the code did before it existed: the run keeps the old value
    monkeypatch.setitem(history.BEFORE, "train.fused_ops", False)
    with pytest.raises(rundir.ConfigChangedError) as e:
        rundir.claim(run_dir, _record())
    assert "(train.fused_ops: False -> True); continue it with the settings it started with: " \
           f"python -m qerl_exp resume={run_dir.absolute()}" in _one_line(e)
    assert from_dict(rundir.resumed(run_dir, config, _record(), set())).train.fused_ops is False


def test_retired_and_renamed_keys_read_as_what_they_mean_now(monkeypatch):
    saved = as_dict(Config())
    saved["train"]["compile"] = True  # retired: sets nothing now
    assert from_dict(saved) == Config()
    monkeypatch.setitem(history.READ_AS, "train.old_kernels", lambda value: {"train.fused_ops": not value})
    del saved["train"]["fused_ops"]
    saved["train"]["old_kernels"] = True
    assert from_dict(saved).train.fused_ops is False
    assert history.upgrade({"train": {"steps": 3}}, before={"train.new": 1, "algo.x": "y"}) == \
        {"train": {"steps": 3, "new": 1}, "algo": {"x": "y"}}


def test_an_unfinished_run_recorded_before_a_field_existed_resumes(tmp_path):
    from qerl_exp import train

    class Stop(Exception):
        pass

    def stop_after_1(step, metrics):
        if step == 1:
            raise Stop

    overrides = [*TINY_RUN, "train.steps=3", "checkpoint.every=1", "monitor.every=0"]
    cfg, choices = compose(overrides)
    run_dir = tmp_path / "run"
    with pytest.raises(Stop):
        train.run(cfg, run_dir, choices=choices, on_step=stop_after_1)
    # the record and the checkpoint as a version without train.fused_ops wrote them
    config = json.loads((run_dir / "config.json").read_text())
    del config["train"]["fused_ops"]
    (run_dir / "config.json").write_text(json.dumps(config))
    state_file = run_dir / "checkpoints" / "step_000002" / "state.pt"
    state = torch.load(state_file, weights_only=False)
    del state["config"]["train"]["fused_ops"]
    torch.save(state, state_file)
    summary = train.run(cfg, run_dir, choices=choices)  # a rerun of the same command continues it
    assert summary["steps"] == 3 and [r["step"] for r in metrics_rows(run_dir)] == [0, 1, 2]


def test_a_record_the_schema_refuses_is_named(tmp_path):
    config = _record()
    config["algo"]["beta"] = "nan"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Refused) as e:
        validate([f"resume={tmp_path}"], multirun=False)
    assert _one_line(e).startswith(f"{Path(tmp_path) / 'config.json'} does not fit this version's config schema "
                                   "(algo.beta must be a finite number, got nan)")
