"""Evaluation: pass@k, that a finished run is scored with its trained LoRA, loaded from disk, and
that every split of the task is scored, in training (from before the first update) and after."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT, SUBPROCESS_ENV, run_in_process
from qerl_exp.config import EvalConfig
from qerl_exp.eval import evaluate, solution_logprobs
from qerl_exp.eval.__main__ import EvalCommand, evaluate_run, load_run, run_config
from qerl_exp.rl.metrics import check_logged, pass_at_k
from qerl_exp.run.checkpoint import ADAPTER_FILE, load_adapter
from qerl_exp.tasks import build_task

# A run small enough to train in seconds: the suite's cached embedded model (conftest's
# `tiny_policy` warms up the same one), 2 RL steps of 2 prompts x 4 completions, no reference
# model, no tracker.
RUN = ["tracker.mode=disabled", "train.steps=2", "train.prompts_per_step=2", "algo.group_size=4", "monitor.every=0",
       "task.eval_size=12"]
FAST = dict(eval=EvalConfig(k=2, max_new_tokens=12, batch_size=16), limit=6, tracker="disabled")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A finished run directory whose adapter was changed by training."""
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    run_in_process(run_dir, *RUN)
    return run_dir


def test_pass_at_k_is_the_chance_that_k_of_n_samples_include_a_correct_one():
    for n in range(1, 7):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))
    with pytest.raises(ValueError):
        pass_at_k(n=2, c=1, k=3)


def _lora(policy) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu() for k, v in get_peft_model_state_dict(policy).items()}


def test_load_run_applies_the_saved_adapter(trained_run):
    saved = load_file(str(trained_run / "final" / "adapter" / ADAPTER_FILE))
    assert any(k.endswith("lora_B.weight") for k in saved)
    assert all(v.abs().max() > 0 for k, v in saved.items() if "lora_B" in k), "training left lora_B at its zero init"
    _, _, models = load_run(trained_run, device="cpu")
    loaded = _lora(models.policy)
    assert loaded.keys() == saved.keys()
    for key in saved:
        torch.testing.assert_close(loaded[key], saved[key], rtol=0, atol=0)
    _, _, fresh = load_run(trained_run, device="cpu", adapter=False)
    assert all(v.abs().max() == 0 for k, v in _lora(fresh.policy).items() if "lora_B" in k)


def test_scores_with_the_trained_adapter_differ_from_the_base(trained_run):
    _, task, models = load_run(trained_run, device="cpu")
    policy, tok = models.policy, models.tokenizer
    problems = task.eval_problems()
    with_lora = solution_logprobs(policy, tok, problems)
    with policy.disable_adapter():
        without = solution_logprobs(policy, tok, problems)
    _, _, base = load_run(trained_run, device="cpu", adapter=False)
    # adapter=False is exactly the base: the fresh LoRA is the identity.
    torch.testing.assert_close(solution_logprobs(base.policy, tok, problems), without)
    # Every problem's score moves: the trained adapter is really in the forward pass.
    assert ((with_lora - without).abs() > 1e-6).all(), (with_lora - without)


def test_evaluation_reads_the_adapter_from_disk(trained_run, tmp_path):
    """Overwrite the adapter file with a different one: the scores follow the file."""
    run_dir = tmp_path / "copy"
    shutil.copytree(trained_run, run_dir, ignore=shutil.ignore_patterns("eval*.json"))
    trained = evaluate_run(EvalCommand(run_dir=str(run_dir), **FAST))
    base = evaluate_run(EvalCommand(run_dir=str(run_dir), adapter=False, temperature=0.7, top_p=0.9, **FAST))

    path = run_dir / "final" / "adapter" / ADAPTER_FILE
    state = load_file(str(path))
    generator = torch.Generator().manual_seed(0)
    save_file({k: v + 0.5 * torch.randn(v.shape, generator=generator) if "lora_B" in k else v
               for k, v in state.items()}, str(path))
    perturbed = evaluate_run(EvalCommand(run_dir=str(run_dir), **FAST))

    logp = [m["eval/solution_logp"] for m in (trained, base, perturbed)]
    assert len(set(logp)) == 3, logp
    first = json.loads((run_dir / "eval.json").read_text())
    assert first["metrics"] == trained  # kept, not replaced
    # the sampling it used, not 0 for "the run's"
    assert first["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "stop": [], "max_new_tokens": 12}
    assert (first["args"]["temperature"], first["args"]["top_p"]) == (1.0, 1.0)
    written = json.loads((run_dir / "eval-2.json").read_text())
    assert written["metrics"] == perturbed and written["adapter"] == str(run_dir / "final" / "adapter")
    base_record = json.loads((run_dir / "eval_base.json").read_text())
    assert (base_record["sampling"]["temperature"], base_record["sampling"]["top_p"]) == (0.7, 0.9)
    base_rows = base_record["problems"]
    assert [r["greedy"] for r in written["problems"]] != [r["greedy"] for r in base_rows]
    assert len(written["problems"]) == 6 and {"question", "answer", "greedy", "correct", "samples_correct"} <= set(written["problems"][0])


def test_evaluate_leaves_mode_and_rng_alone_and_is_seeded(trained_run):
    _, task, models = load_run(trained_run, device="cpu")
    policy = models.policy
    policy.train()
    state = torch.get_rng_state()
    a = evaluate(policy, models.tokenizer, task, k=2, max_new_tokens=12, problems=task.eval_problems()[:4], seed=3)
    assert policy.training and torch.equal(torch.get_rng_state(), state)
    b = evaluate(policy, models.tokenizer, task, k=2, max_new_tokens=12, problems=task.eval_problems()[:4], seed=3)
    drop = lambda m: {k: v for k, v in m.items() if k != "eval/seconds"}  # noqa: E731
    assert drop(a) == drop(b)
    assert set(a) == {"eval/pass@1", "eval/pass@2", "eval/mean@2", "eval/format", "eval/reward", "eval/clipped_ratio",
                      "eval/solution_logp", "eval/problems", "eval/seconds"}
    assert 0 <= a["eval/pass@1"] <= 1 and a["eval/mean@2"] <= a["eval/pass@2"] <= 1 and a["eval/problems"] == 4
    with pytest.raises(ValueError, match="k >= 2"):
        evaluate(policy, models.tokenizer, task, k=-1)


def test_load_adapter_refuses_a_file_that_does_not_fit(trained_run, tmp_path):
    _, _, models = load_run(trained_run, device="cpu", adapter=False)
    state = load_file(str(trained_run / "final" / "adapter" / ADAPTER_FILE))
    dropped = sorted(state)[0]
    save_file({k: v for k, v in state.items() if k != dropped}, str(tmp_path / ADAPTER_FILE))
    with pytest.raises(ValueError, match="1 missing"):
        load_adapter(models.policy, tmp_path)
    with pytest.raises(FileNotFoundError, match="saved no trained adapter"):
        load_adapter(models.policy, tmp_path / "nowhere")


@pytest.mark.slow
def test_command_line_writes_eval_json(trained_run, tmp_path):
    run_dir = tmp_path / "copy"
    shutil.copytree(trained_run, run_dir, ignore=shutil.ignore_patterns("eval*.json"))
    out = subprocess.run([sys.executable, "-m", "qerl_exp.eval", f"run_dir={run_dir}", "k=2", "limit=3", "max_new_tokens=8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=SUBPROCESS_ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = json.loads((run_dir / "eval.json").read_text())["metrics"]
    assert {"eval/pass@1", "eval/pass@2", "eval/mean@2"} <= set(metrics) and metrics["eval/problems"] == 3
    assert "eval/pass@1=" in out.stdout and str(run_dir / "eval.json") in out.stdout


@pytest.mark.parametrize("args, message", [
    (["run_dir=RUN", "kk=2"], "error: unknown argument 'kk'; keys: run_dir, k, n,"),
    (["run_dir=RUN", "k=two"], "error: bad value for 'k': 'two' is not an int"),
    (["run_dir=RUN", "adapter=maybe"], "error: bad value for 'adapter': 'maybe' is not a bool"),
    (["run_dir=RUN", "k=-1"], "error: k must be >= 2 for sampled pass@k, or 0 or 1 for the greedy pass@1 alone, got -1"),
    (["run_dir=RUN", "k=4", "n=3"], "error: n must be 0 or >= k, got 3"),
    (["run_dir=RUN", "tracker=loud"], "error: tracker='loud' is not valid; choose one of: run, offline"),
    (["k=2"], "error: run_dir=<a run directory> is required"),
    (["run_dir=RUN"], "error: FileNotFoundError: "),
    (["run_dir=RUN", "split=train"], "error: split='train' is not valid; choose one of: heldout, ood"),
])
def test_command_line_errors_are_one_line(args, message, tmp_path, capsys):
    from qerl_exp.eval.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main([a.replace("RUN", str(tmp_path / "none")) for a in args])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code != 0 and len(err) == 1 and err[0].startswith(message), err


# Word problems on the embedded model at its random initialization (no warm-up to cache): two
# splits of 4 problems, evaluated before the first update and after the last (step 1).
WORDPROB = ["task=wordprob", "model.warmup.max_steps=0", "model.max_positions=512", "tracker.mode=disabled",
            "train.steps=2", "train.prompts_per_step=2", "algo.group_size=2", "algo.max_new_tokens=6", "monitor.every=0",
            "checkpoint.every=0", "eval.every=2", "eval.at_start=true", "eval.k=0", "task.eval_size=4"]


def test_training_evaluates_both_splits_from_the_start_and_the_command_names_its_split(tmp_path):
    run_dir = tmp_path / "run"
    rows = run_in_process(run_dir, *WORDPROB)
    first, last = rows[0], rows[-1]
    for prefix in ("eval/start/", "eval/ood/start/"):
        assert first[f"{prefix}problems"] == 4 and 0 <= first[f"{prefix}pass@1"] <= 1
    assert not any(k.startswith("eval/") and "/start/" not in k for k in first)  # eval.every=2: none after step 0
    assert last["eval/problems"] == last["eval/ood/problems"] == 4 and not any("/start/" in k for k in last)
    # two different problem sets were scored, not one twice
    assert first["eval/start/solution_logp"] != first["eval/ood/start/solution_logp"]
    for name in set().union(*rows) - {"step"}:
        check_logged(name)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval/ood/start/pass@1"] == first["eval/ood/start/pass@1"] and summary["eval/ood/pass@1"] == last["eval/ood/pass@1"]

    # The base, scored afterwards by the command: what the start evaluation measured.
    settings = dict(eval=EvalConfig(k=0, max_new_tokens=6, batch_size=64), tracker="disabled")
    base = evaluate_run(EvalCommand(run_dir=str(run_dir), adapter=False, split="ood", **settings))
    assert base["eval/ood/pass@1"] == first["eval/ood/start/pass@1"]
    assert base["eval/ood/solution_logp"] == pytest.approx(first["eval/ood/start/solution_logp"], abs=1e-5)
    record = json.loads((run_dir / "eval_base_ood.json").read_text())
    assert record["split"] == "ood" and set(record["metrics"]) == set(base)
    task = build_task(run_config(run_dir).task)
    trained = evaluate_run(EvalCommand(run_dir=str(run_dir), split="ood", limit=3, **settings))
    record = json.loads((run_dir / "eval_ood.json").read_text())
    assert record["split"] == "ood" and trained["eval/ood/problems"] == 3
    assert [r["question"] for r in record["problems"]] == [p.question for p in task.eval_problems("ood")[:3]]
    held = evaluate_run(EvalCommand(run_dir=str(run_dir), limit=3, **settings))
    assert json.loads((run_dir / "eval.json").read_text())["split"] == "heldout" and "eval/pass@1" in held


def test_a_split_the_runs_task_lacks_is_refused_before_the_model_is_built(trained_run, capsys):
    from qerl_exp.eval.__main__ import main

    with pytest.raises(SystemExit):
        main([f"run_dir={trained_run}", "split=ood"])
    assert capsys.readouterr().err.strip() == ("error: ValueError: split='ood' is not a split of task arith; "
                                               "choose one of: heldout")
    assert not list(trained_run.glob("eval_ood*.json"))


@pytest.mark.parametrize("config, args, message", [
    (None, [], "error: FileNotFoundError: RUN/final/adapter/adapter_model.safetensors does not exist: the run saved no "
               "trained adapter (did it finish?)"),
    (None, ["adapter=false", "out=sub/eval.json"], "error: ValueError: out=sub/eval.json: RUN/sub is not a folder; create "
                                                   "it or choose another out="),
    (b"\x00\xff", [], "error: RecordError: RUN/config.json is not readable JSON"),
    (b'{"lora": {"rank": 8}}', [], "error: ValueError: RUN/config.json does not fit the current config schema"),
])
def test_what_eval_needs_is_checked_before_the_model_is_built(trained_run, tmp_path, capsys, config, args, message):
    from qerl_exp.eval.__main__ import main

    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir, ignore=shutil.ignore_patterns("final", "eval*.json"))
    saved = json.loads((run_dir / "config.json").read_text())
    saved["model"]["cache_dir"] = str(tmp_path / "cache")  # a model built for this evaluation would be cached here
    (run_dir / "config.json").write_bytes(config or json.dumps(saved).encode())
    with pytest.raises(SystemExit) as exit_:
        main([f"run_dir={run_dir}", "tracker=disabled", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 1 and len(err) == 1 and err[0].startswith(message.replace("RUN", str(run_dir))), err
    assert not (tmp_path / "cache").exists()


def test_wandb_that_cannot_start_keeps_the_evaluation(trained_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir, ignore=shutil.ignore_patterns("eval*.json", "wandb"))
    (run_dir / "wandb").write_text("")  # a file where W&B keeps its runs
    args = EvalCommand(run_dir=str(run_dir), eval=EvalConfig(k=0, max_new_tokens=8), limit=1, tracker="offline")
    with pytest.warns(UserWarning, match="W&B failed .*; the results are in the evaluation file only"):
        metrics = evaluate_run(args)
    assert json.loads((run_dir / "eval.json").read_text())["metrics"] == metrics


def test_an_evaluation_leaves_latest_run_at_the_training_runs_wandb_file(tmp_path):
    run_dir = tmp_path / "run"
    run_in_process(run_dir, *[o for o in RUN if not o.startswith("tracker")], "tracker.mode=offline", "train.steps=1")
    latest = run_dir / "wandb" / "latest-run"
    training = os.readlink(latest)
    evaluate_run(EvalCommand(run_dir=str(run_dir), eval=EvalConfig(k=0, max_new_tokens=4), limit=1, tracker="offline"))
    assert len(list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))) == 2  # the training run's and the evaluation's
    assert os.readlink(latest) == training
    # the README's glob: the training run's file alone
    assert [p.resolve().parent.name for p in run_dir.glob("wandb/latest-run/run-*.wandb")] == [Path(training).name]
