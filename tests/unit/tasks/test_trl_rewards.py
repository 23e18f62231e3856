"""Reward functions with every argument TRL's GRPOTrainer passes: `completion_ids` (checked against
the tokens the run counts), `trainer_state`, `log_extra` and `log_metric`; async functions awaited
together; keyword arguments from the config; TRL's own `trl.rewards` helpers; and a prompt-only data
set whose functions need no answer, run end to end on a small checkpoint."""

from __future__ import annotations

import json
import textwrap

import pytest

from conftest import metrics_rows, run_in_process, save_checkpoint
from qerl_exp.config import TaskConfig
from qerl_exp.config.compose import compose
from qerl_exp.config.schema import ConfigError
from qerl_exp.tasks import Problem, build_task
from qerl_exp.tasks.reward_funcs import RewardError, load, trainer_state

SMALL = ["tracker.mode=disabled", "train.prompts_per_step=2", "algo.group_size=2", "monitor.every=0",
         "algo.max_new_tokens=8", "tracker.completions_every=1"]

LENGTHS = '''
def length(completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
    """Each completion's token count; logs the step it saw and each completion's text length."""
    log_metric("step_seen", trainer_state.global_step)
    log_metric("epoch_seen", trainer_state.epoch)
    log_extra("chars", [len(c) for c in completions])
    return [float(len(ids)) for ids in completion_ids]
'''


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("qwen3") / "ckpt", "qwen3")


def _write(folder, name, text):
    (folder / name).write_text(textwrap.dedent(text))
    return folder / name


def test_a_token_length_reward_on_prompt_only_data_runs_with_trls_arguments(checkpoint, tmp_path):
    rewards = _write(tmp_path, "rewards.py", LENGTHS)
    prompts = [f"Count to {n}:" for n in range(6)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))  # no answer column
    run = tmp_path / "run"
    rows = run_in_process(run, f"model.name={checkpoint}", "task=dataset", f"task.path={data}", "task.eval_size=0",
                          f"task.reward_funcs=[{rewards}:length]", "train.steps=4", *SMALL)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        # completion_ids are the tokens the run counts (EOS included), one list per completion
        assert r["rewards/length/mean"] == pytest.approx(r["completions/mean_length"])
        assert r["rewards/length/step_seen"] == r["step"]  # trainer_state.global_step: updates done before
        assert r["rewards/length/epoch_seen"] == pytest.approx(r["step"] * 2 / 6)
        assert r["epoch"] == pytest.approx((r["step"] + 1) * 2 / 6)  # the epoch sampler's progress
    samples = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert all(s["extra"]["chars"] == len(s["completion"]) for s in samples)
    assert all(s["prompt"] in prompts for s in samples)  # text prompts as they are (the dataset preset: verbatim)
    # the epoch sampler: steps 0-2 draw each of the 6 prompts once, steps 3-5 would again
    first_epoch = [s["prompt"] for s in samples if s["step"] < 3][::2]
    assert sorted(first_epoch) == sorted(prompts)
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["data/train_prompts"], summary["data/held_out_prompts"], summary["data/duplicate_prompts"]) == (6, 0, 0)
    from qerl_exp.eval.__main__ import EvalCommand, evaluate_run

    with pytest.raises(ValueError, match=f"run_dir={run} holds no problem out for evaluation"):
        evaluate_run(EvalCommand(run_dir=str(run), tracker="disabled"))


def test_async_functions_are_awaited_together_beside_sync_ones(tmp_path):
    # each waits for the other's event: awaited one after the other, the first would time out
    rewards = _write(tmp_path, "pair.py", '''
        import asyncio
        EVENTS = {}

        def _events():
            loop = asyncio.get_running_loop()
            if EVENTS.get("loop") is not loop:
                EVENTS.update(loop=loop, a=asyncio.Event(), b=asyncio.Event())
            return EVENTS

        async def ping(completions, **kwargs):
            e = _events()
            e["a"].set()
            await asyncio.wait_for(e["b"].wait(), 5)
            return [1.0] * len(completions)

        async def pong(completions, **kwargs):
            e = _events()
            e["b"].set()
            await asyncio.wait_for(e["a"].wait(), 5)
            return [2.0] * len(completions)

        def plain(completions, **kwargs):
            return [3.0] * len(completions)
    ''')
    funcs = load(TaskConfig(reward_funcs=[f"{rewards}:ping", f"{rewards}:plain", f"{rewards}:pong"]), ["answer"])
    scores = funcs.compute([Problem("q", "1")] * 2, ["a", "b"], "step 0")
    assert scores == {"ping": [1.0, 1.0], "plain": [3.0, 3.0], "pong": [2.0, 2.0]}


def test_keyword_arguments_from_the_config_reach_the_function(tmp_path):
    rewards = _write(tmp_path, "scaled.py", '''
        def scaled(completions, scale, offset=0.0, **kwargs):
            return [scale * len(c) + offset for c in completions]

        def strict(prompts, completions, answer, scale):
            return [scale] * len(completions)
    ''')
    spec = f"task.reward_funcs=[{rewards}:scaled]"
    cfg = compose([spec, "+task.reward_kwargs.scaled.scale=2.0", "+task.reward_kwargs.scaled.offset=0.5"])[0]
    assert build_task(cfg.task).rewards.compute([Problem("q", "1")] * 2, ["ab", "abc"], "step 0") == {"scaled": [4.5, 6.5]}
    with pytest.raises(ConfigError, match=r"reward function scaled .* needs 'scale', which is not a column of the "
                                          r"task's rows \(they give: answer\) nor one of its task.reward_kwargs"):
        build_task(compose([spec])[0].task)
    with pytest.raises(ConfigError, match=r"^task.reward_kwargs.strict.power: reward function strict .* takes no "
                                          r"argument 'power' \(it takes: prompts, completions, answer, scale\)$"):
        build_task(compose([f"task.reward_funcs=[{rewards}:strict]", "+task.reward_kwargs.strict.scale=1",
                            "+task.reward_kwargs.strict.power=2"])[0].task)
    with pytest.raises(ConfigError, match=r"^task.reward_kwargs.other names no function of task.reward_funcs \(scaled\)"):
        compose([spec, "+task.reward_kwargs.other.scale=1"])
    with pytest.raises(ConfigError, match=r"task.reward_kwargs.scaled.completion_ids is an argument the run passes itself"):
        build_task(compose([spec, "+task.reward_kwargs.scaled.scale=1", "+task.reward_kwargs.scaled.completion_ids=1"])[0].task)


def test_trls_own_reward_helpers_run(tmp_path):
    """The helpers of `trl.rewards` that read `completion_ids` (made in a file of yours, as in TRL)
    give here what they give when called directly."""
    from trl.rewards import get_cosine_scaled_reward, get_repetition_penalty_reward, get_soft_overlong_punishment

    rewards = _write(tmp_path, "trl_rewards.py", '''
        from trl.rewards import (accuracy_reward, get_cosine_scaled_reward, get_repetition_penalty_reward,
                                 get_soft_overlong_punishment, think_format_reward)
        overlong = get_soft_overlong_punishment(max_completion_len=6, soft_punish_cache=2)
        repetition = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
        cosine = get_cosine_scaled_reward(max_len=8)
    ''')
    names = ["overlong", "repetition", "cosine", "accuracy_reward", "think_format_reward"]
    funcs = load(TaskConfig(reward_funcs=[f"{rewards}:{n}" for n in names]), ["answer", "solution"])
    problems = [Problem("q", "4", messages=({"role": "user", "content": "2+2?"},), columns={"solution": "$4$"})] * 3
    texts = ["<think>x</think>\\boxed{4}", "\\boxed{5}", "\\boxed{4} 4 4 4"]
    ids = [[1, 2, 3], [4, 4, 4, 4, 4], [5, 6, 5, 6, 5, 6, 5]]
    scores = funcs.compute(problems, texts, "step 0", completion_ids=ids, state=trainer_state(0, 10, 0.0))
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    assert scores["overlong"] == get_soft_overlong_punishment(6, 2)(completion_ids=ids)
    assert scores["repetition"] == get_repetition_penalty_reward(2, -1.0)(completion_ids=ids)
    assert scores["cosine"] == pytest.approx(get_cosine_scaled_reward(max_len=8)(completions, ["$4$"] * 3, ids))
    assert scores["accuracy_reward"] == [1.0, 0.0, 1.0]
    assert funcs.extra["solution"] == ["$4$"] * 3  # accuracy_reward logs its columns through log_extra


def test_a_function_that_cannot_run_is_refused_before_the_run(tmp_path):
    rewards = _write(tmp_path, "kinds.py", '''
        class Scorer:
            def __call__(self, completions, **kwargs):
                return [0.0] * len(completions)

        def counting(completions, **kwargs):
            yield from [0.0] * len(completions)

        def logs_badly(completions, log_metric, **kwargs):
            log_metric("mean", 1.0)
            return [0.0] * len(completions)
    ''')
    for name, message in (("Scorer", "Scorer is a class; name an instance of it"),
                          ("counting", "counting is a generator; return the list of rewards")):
        with pytest.raises(ConfigError, match=message):
            load(TaskConfig(reward_funcs=[f"{rewards}:{name}"]), ["answer"])
    funcs = load(TaskConfig(reward_funcs=[f"{rewards}:logs_badly"]), ["answer"])
    with pytest.raises(RewardError, match="logged 'mean': 1.0 at step 3; log_metric takes a name other than mean and std"):
        funcs.compute([Problem("q", "1")], ["a"], "step 3")
    with pytest.raises(ConfigError, match="the built-in correct judges replies against the answer column, which the data "
                                          "lacks"):
        load(TaskConfig(), ["difficulty"])
