"""Held-out evaluation with the trained LoRA applied: greedy pass@1 and sampled pass@k.

Three ways in:
- `evaluate(policy, tokenizer, task, k=..., split=...)` grades a live policy on one of the task's
  evaluation splits (`heldout`, phrased as training is; `ood`, out of template, for tasks that have
  one) and returns its metrics; the embedded model's warm-up measures its progress with
  `rl.rollout.greedy_pass_at_1`.
- `evaluate_in_training(policy, tokenizer, task, cfg)`: every split of the task with the run's
  `eval.*` settings, what the run loop logs every `eval.every` steps (and with `eval.at_start`
  before the first update).
- `python -m qerl_exp.eval run_dir=RUN [k=8] [adapter=false] [split=ood] ...` (`__main__.py` here)
  rebuilds a finished run's policy from `RUN/config.json` (the same base, for the embedded model
  its cached warm-up, and the same quantization), loads the trained adapter from
  `RUN/final/adapter`, grades one split and writes `RUN/eval.json` (`eval_ood.json` for the
  out-of-template split; and a W&B run of job type `eval`); a later evaluation of the same run and
  split writes `RUN/eval-2.json`, and so on: none replaces another.

The paper's released evaluation compared only the first character of the answer and never applied
the trained LoRA (docs/method.md, section 3). Here completions are graded by the run's own reward
functions (`task.reward_funcs`, as training rewards them): a completion is correct when the function
named `correct` gives it a positive value (the built-in one: `answers_equal`, whole answers,
exactly), in format when `format` does; a run without such a function logs NaN for those. And
`load_adapter` refuses an adapter file that does not cover every LoRA weight of the rebuilt policy.

Metrics (over the held-out problems; the out-of-template split's are named `eval/ood/...`, and
those of the evaluation before the first update `eval/start/...` and `eval/ood/start/...`,
`metrics.eval_prefix`):

| name                  | meaning                                                                   |
|-----------------------|---------------------------------------------------------------------------|
| `eval/pass@1`         | fraction answered correctly by the greedy completion (`correct` > 0)      |
| `eval/pass@{k}`       | unbiased pass@k (Chen et al. 2021) from `n >= k` samples per problem      |
| `eval/mean@{n}`       | fraction of all sampled completions that are correct (sampled pass@1)    |
| `eval/format`         | fraction of greedy completions in format (`format` > 0; the built-in one: `<think>..</think><answer>..</answer>`) |
| `eval/reward`         | mean weighted reward (the run's reward functions) of greedy completions   |
| `eval/clipped_ratio`  | fraction of greedy completions cut at `max_new_tokens` without EOS        |
| `eval/solution_logp`  | mean per-token log-prob of each problem's reference completion (teacher-forced) |
| `eval/problems`       | number of problems graded                                                  |
| `eval/seconds`        | wall time of the evaluation                                               |
| `eval/fork/b_share`   | `task=fork`: fraction of greedy replies that take route B                 |
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from qerl_exp.config import Config
from qerl_exp.decoders.batch import Sequences
from qerl_exp.decoders.scoring import score_completions
from qerl_exp.rl import metrics as M
from qerl_exp.rl.rollout import complete, encode_prompts, engine_for, greedy_completions, policy_device
from qerl_exp.tasks import SYSTEM_PROMPT, Problem, reference_completion
from qerl_exp.tasks.base import HELD_OUT
from qerl_exp.tasks.reward_funcs import FORMAT, JUDGE


@torch.no_grad()
def solution_logprobs(policy, tokenizer, problems: list[Problem], *, system_prompt: str = SYSTEM_PROMPT,
                      batch_size: int = 64) -> torch.Tensor:
    """Mean per-token log-prob `[N]` of each problem's reference completion under `policy`.

    The reference completion is the warm-up's target (`tasks.reference_completion`), teacher-forced
    after the rendered prompt by the learner's scorer (`scoring.score_completions`, temperature 1). A
    smooth, sampling-free score: any change of the adapter moves it, which makes it the sharpest
    check that an adapter is applied.

    Args:
        policy: the model to score (eval mode is the caller's business).
        tokenizer: the policy's tokenizer.
        problems: the problems to score.
        system_prompt: passed to `tokenizer.render_prompt`.
        batch_size: problems per forward pass.

    Returns:
        A float32 CPU tensor, one value per problem.
    """
    out = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        prompts = [tokenizer.render_prompt(p.prompt, system_prompt) for p in chunk]
        ids, mask = encode_prompts(prompts, tokenizer, policy_device(policy))
        targets = [tokenizer.encode(reference_completion(p)) for p in chunk]
        width = max(map(len, targets))
        tgt = torch.full((len(chunk), width), tokenizer.pad_id, dtype=torch.long, device=ids.device)
        tmask = torch.zeros_like(tgt)
        for i, t in enumerate(targets):
            tgt[i, : len(t)] = torch.tensor(t)
            tmask[i, : len(t)] = 1
        logp, _ = score_completions(policy, Sequences(ids, mask, tgt, tmask), temperature=1.0)
        out.append((logp.sum(dim=1) / tmask.sum(dim=1).clamp(min=1)).cpu())
    return torch.cat(out)


def samples_per_problem(k: int, n: int) -> int:
    """Sampled completions per problem for pass@k: `n`, or `k` when n is 0; none at k = 0 or 1,
    whose pass@1 is the greedy one."""
    return (n or k) if k > 1 else 0


def grade(policy, tokenizer, task, *, problems: list[Problem] | None, k: int, n: int, temperature: float,
          top_p: float, max_new_tokens: int, batch_size: int, seed: int, system_prompt: str,
          on_batch=None, engine: str = "hf", split: str = HELD_OUT, start: bool = False, top_k: int = 0,
          min_p: float = 0.0, stop: Sequence[str] = (), state=None) -> tuple[dict[str, float], list[dict]]:
    """`evaluate`'s metrics and one row per problem (question, reference, greedy completion,
    verdicts); the arguments are `evaluate`'s, and `on_batch(rows)` follows each generated batch."""
    if k < 0:
        raise ValueError(f"k={k}: use k >= 2 for sampled pass@k, or k=0 or 1 for the greedy pass@1 alone")
    n = samples_per_problem(k, n)
    k = 0 if k == 1 else k  # pass@1 is the greedy one, always reported
    if k and n < k:
        raise ValueError(f"n={n} samples per problem cannot estimate pass@{k}; use n >= k")
    problems = list(task.eval_problems(split) if problems is None else problems)
    prompts = [tokenizer.render_prompt(p.prompt, system_prompt) for p in problems]
    t0, was_training = time.perf_counter(), policy.training
    device = policy_device(policy)
    policy.eval()
    try:
        # A private RNG stream: evaluating mid-run must not change the run's later random draws,
        # and the same seed gives the same samples.
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            greedy, terminated, greedy_ids = greedy_completions(
                policy, tokenizer, problems, system_prompt=system_prompt, max_new_tokens=max_new_tokens,
                batch_size=batch_size, on_batch=on_batch, engine=engine, stop=stop)
            sampled, _, sampled_ids = complete(
                policy, tokenizer, prompts, samples=n, temperature=temperature, top_p=top_p,
                max_new_tokens=max_new_tokens, batch_size=batch_size, on_batch=on_batch, engine=engine, top_k=top_k,
                min_p=min_p, stop=stop) if k else ([], [], [])
            logp = solution_logprobs(policy, tokenizer, problems, system_prompt=system_prompt, batch_size=batch_size)
    finally:
        policy.train(was_training)

    where = f"evaluation ({split})"
    scores = task.rewards.compute(problems, greedy, where, completion_ids=greedy_ids, state=state)
    # float64, as the values came: the weighted sum of the built-in 0.2 and 2.0 stays 2.2
    rewards = M.total_reward({name: torch.tensor(v, dtype=torch.float64) for name, v in scores.items()},
                             task.rewards.weights).tolist()
    is_correct, in_format = ([v > 0 for v in scores[name]] if name in scores else [] for name in (JUDGE, FORMAT))
    rows = [{"question": p.question, "answer": p.answer, "greedy": t, "correct": is_correct[i] if is_correct else None,
             "terminated": ended, "rewards": {name: None if math.isnan(v[i]) else v[i] for name, v in scores.items()},
             "solution_logp": float(lp)} for i, (p, t, ended, lp) in enumerate(zip(problems, greedy, terminated, logp))]
    verdicts = task.rewards.verdicts([p for p in problems for _ in range(n)], sampled, where, completion_ids=sampled_ids,
                                     state=state) if k else None
    counts = [sum(verdicts[i * n:(i + 1) * n]) for i in range(len(problems))] if verdicts else []
    for row, c in zip(rows, counts):
        row["samples_correct"] = f"{c}/{n}"
    metrics = M.eval_metrics(is_correct, in_format, rewards, terminated, logp, counts, n, k, time.perf_counter() - t0,
                             prefix=M.eval_prefix(split, start))
    if hasattr(task, "eval_metrics"):  # a task's own (task=fork: the route of the greedy replies)
        metrics.update(task.eval_metrics(greedy, M.eval_prefix(split, start)))
    return metrics, rows


def evaluate(policy, tokenizer, task, *, k: int = 8, n: int = 0, temperature: float = 1.0, top_p: float = 1.0,
             max_new_tokens: int = 32, batch_size: int = 64, seed: int = 0, system_prompt: str = SYSTEM_PROMPT,
             problems: list[Problem] | None = None, engine: str = "hf", split: str = HELD_OUT,
             start: bool = False, top_k: int = 0, min_p: float = 0.0, stop: Sequence[str] = (),
             state=None) -> dict[str, float]:
    """Grade `policy` on one evaluation split: greedy pass@1, and pass@k from sampling.

    Call it with the policy as it samples in deployment: adapters enabled and AQN off (outside
    `aqn.applied(...)`). The policy's train/eval mode is restored afterwards, and the global RNG
    state is left untouched (sampling uses its own stream, seeded by `seed`).

    Args:
        policy: the (peft-wrapped) model; its adapters are used as they are.
        tokenizer: the policy's tokenizer (`CharTokenizer` or `HFTokenizer`).
        task: the task; its `eval_problems(split)` are graded and its `correct` reward judges answers.
        k: the k of the sampled pass@k; 0 or 1 skips sampling (greedy metrics only).
        n: samples per problem for the pass@k estimate; 0 means `k`.
        temperature: sampling temperature of the pass@k samples (greedy ignores it).
        top_p: nucleus threshold of the pass@k samples.
        max_new_tokens: completion length cap.
        batch_size: sequences per `generate` call.
        seed: seed of the sampling stream.
        system_prompt: the system prompt for chat-template tokenizers.
        problems: grade these instead of `task.eval_problems(split)`.
        engine: `hf` (transformers `generate`) or `fast` (the CUDA-graph rollout engine; the run
            loop and `python -m qerl_exp.eval` pass `rollout.engine`, so `auto` is fast on CUDA).
        split: one of `task.splits`: `heldout` (its metrics are `eval/...`) or `ood` (`eval/ood/...`).
        start: name the metrics as the evaluation before the first update (`eval/start/...`).
        top_k: top-k of the pass@k samples (0: off).
        min_p: min-p of the pass@k samples (0: off).
        stop: strings that end every completion, greedy or sampled (`algo.stop`).
        state: the `transformers.TrainerState` reward functions get as `trainer_state`
            (`tasks.reward_funcs.trainer_state`); None: not passed.

    Returns:
        The metrics listed in this module's docstring.

    Example:
        >>> metrics = evaluate(models.policy, models.tokenizer, task, k=8)  # doctest: +SKIP
        >>> metrics["eval/pass@1"], metrics["eval/pass@8"]  # doctest: +SKIP
    """
    return grade(policy, tokenizer, task, problems=problems, k=k, n=n, temperature=temperature, top_p=top_p,
                 max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, system_prompt=system_prompt,
                 engine=engine, split=split, start=start, top_k=top_k, min_p=min_p, stop=stop, state=state)[0]


def evaluate_in_training(policy, tokenizer, task, cfg: Config, *, start: bool = False, state=None) -> dict[str, float]:
    """The run loop's evaluation: every split of the task, with the run's `eval.*` settings, its
    sampling settings (temperature, top-p, top-k, min-p, stop strings), and its rollout engine.

    Args:
        policy: the policy being trained (adapters on, AQN off).
        tokenizer: its tokenizer.
        task: the run's task; each of `task.splits` is graded.
        cfg: the run config.
        start: the evaluation before the first update (`eval.at_start`): its metrics are named
            `eval/start/...` and `eval/ood/start/...`.
        state: the run's `transformers.TrainerState` at this evaluation, for the reward functions.

    Returns:
        The metrics of every split, e.g. `eval/pass@1` and `eval/ood/pass@1` for `task=wordprob`.
    """
    out = {}
    for split in task.splits:
        out.update(evaluate(
            policy, tokenizer, task, k=cfg.eval.k, n=cfg.eval.n, temperature=cfg.algo.temperature, top_p=cfg.algo.top_p,
            max_new_tokens=cfg.eval.max_new_tokens or cfg.algo.max_new_tokens, batch_size=cfg.eval.batch_size,
            seed=cfg.seed, system_prompt=cfg.task.system_prompt, engine=engine_for(cfg.rollout.engine, policy_device(policy)),
            split=split, start=start, top_k=cfg.algo.top_k, min_p=cfg.algo.min_p, stop=cfg.algo.stop, state=state))
    return out
