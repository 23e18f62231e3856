"""Every logged metric, defined once, as pure functions from tensors to `dict[str, float]`.

Names follow TRL's GRPO trainer where one exists (docs/method.md, section 5). The run loop only calls
these functions; it never builds metric names itself. Token means are over completion tokens
(`mask == 1`) of the whole batch (in a data-parallel run, every rank's rows: `qerl_exp.run.distributed`).

| name | definition |
| --- | --- |
| reward | mean reward per completion: the weighted sum of the reward functions (`total_reward`), over the completions some function applies to |
| reward_std | std of that reward over the batch's completions (as TRL logs it) |
| reward_group_std | mean over groups of the within-group std of the reward |
| rewards/<fn>/mean, rewards/<fn>/std | mean and std of reward function `fn`'s values, unweighted, over the completions it applies to (not None), as TRL logs them |
| frac_reward_zero_std | fraction of groups whose rewards are all equal (no learning signal) |
| completions/mean_length | mean completion length in tokens (EOS included) |
| completions/clipped_ratio | fraction of completions cut at max_new_tokens without EOS or a stop string |
| clip_ratio/low_mean | fraction of tokens with negative advantage whose ratio fell below 1 - eps_low, over every token of every update of the step (0 with one update: the ratio is 1) |
| clip_ratio/high_mean | fraction of tokens with positive advantage whose ratio rose above 1 + eps_high, likewise |
| kl | token mean of the k3 estimator exp(r) - r - 1, r = logp_ref - logp, against the reference policy (the base without LoRA); logged every step when `algo.beta > 0`, else every `monitor.kl_every` steps |
| entropy | token mean of the learner's entropy of softmax(logits / T) on the sampled tokens, before the step's update (TRL's `entropy`) |
| sampler/entropy | the on-policy entropy: token mean of the sampler's entropy (quantization and noise included) on its own rollouts |
| entropy_gain | the same-token entropy gain on the sampler's tokens: sampler/entropy minus the full-precision reference's entropy on those tokens (`monitor.every`) |
| quant/kl | token mean of the KL divergence from the full-precision reference to the sampler, sum over the vocabulary of p_ref (log p_ref - log p_sampler), on the sampler's tokens |
| sampling/logp_gap | token mean of abs(sampler logp - learner logp) of the sampled tokens (learner before the update; 0 up to rounding when sampler and learner are one clean policy) |
| noise/sigma, noise/stage | the AQN sigma of this step's rollout (the schedule's value), and its stage |
| noise/sigma_eff_min, noise/sigma_eff_median, noise/sigma_eff_max | the standard deviation of the noise each noised norm's scale gets, over those norms: noise/sigma, times each norm's median abs(gamma) with `noise.relative` |
| perf/rollout_tok_s | completion tokens generated per second of rollout wall time (data-parallel: all ranks' tokens over the slowest rank's time) |
| perf/step_s | wall time of the whole step |
| timing_s/rollout, timing_s/reference, timing_s/monitor, timing_s/learner, timing_s/optimizer, timing_s/sync | seconds of the step in sampling, in the reference (base without LoRA) forward for `kl` (0 on steps without one), in the noise monitor (0 on steps it skips), in the learner's forward and backward passes, in gradient clipping and optimizer steps (with the gradients' all-reduce in a data-parallel run), in re-quantizing a separate sampler (`rollout.quant`; 0 without one); each the slowest rank's |
| mem/weights_bytes | bytes of every parameter and buffer of the policy (quantized layers with all their scales) |
| mem/quantized_linear_bytes | bytes of the quantized linears alone |
| mem/rollout_bytes | device bytes of the rollout engine beyond the model: KV cache, buffers, NF4's second layout |
| mem/load_peak_bytes | peak device memory (CUDA) or resident set size (CPU) while the models were built |
| mem/peak_bytes | peak device memory of the step (CUDA; the max of the two below) or peak resident set size (CPU) |
| mem/rollout_peak_bytes, mem/learner_peak_bytes | CUDA: the step's peak in the rollout, and in the reference, monitor and learner passes |
| loss, grad_norm, lr | the optimized loss and the global grad norm before clipping (means over the step's optimizer steps), the learning rate |
| train/skipped | 1 when the step's loss or gradient was not finite and the update was skipped |
| epoch | tasks that read data (`task=gsm8k`, `math`, `dataset`): the passes over the training prompts drawn through this step, prompts_per_step x steps / training prompts (TRL's fractional `epoch`) |
| rewards/<fn>/<name> | what reward function `fn` logged with `log_metric(name, value)` in the step: the mean of its values (every call, every rank) |
| noise/target_error | `noise=adaptive` only: the controller's set point minus the measured entropy (or entropy gain) |
| noise/target | `noise=adaptive` only: the controller's set point in nats (`noise.target_value`, or with `noise.target_relative` that multiple of the learner's entropy on the first step's rollout) |
| fork/b_share | `task=fork` only: the share of the step's completions that take route B (`tasks.fork`) |
| fork/route_entropy | `task=fork` only: the sampler's entropy at each completion's route token (its first token), mean over the step's completions |
| eval/pass@1, eval/pass@k, eval/mean@n, eval/format, eval/reward, eval/clipped_ratio, eval/solution_logp, eval/problems, eval/seconds | held-out evaluation (`eval.every`, `python -m qerl_exp.eval`): greedy exact-answer accuracy, unbiased pass@k over n samples, their mean accuracy, greedy format rate, reward, truncation rate, mean log-prob of the reference solutions, problem count, wall time |
| eval/ood/pass@1, eval/ood/pass@k, eval/ood/mean@n, eval/ood/format, eval/ood/reward, eval/ood/clipped_ratio, eval/ood/solution_logp, eval/ood/problems, eval/ood/seconds | the same on the task's out-of-template split (`wordprob`'s `ood`), logged beside the held-out ones by every evaluation of a task that has one |
| eval/fork/b_share, eval/start/fork/b_share | `task=fork` only: the share of an evaluation's greedy replies that take route B (before the first update: `start/`) |
| eval/start/pass@1, eval/start/pass@k, eval/start/mean@n, eval/start/format, eval/start/reward, eval/start/clipped_ratio, eval/start/solution_logp, eval/start/problems, eval/start/seconds, eval/ood/start/pass@1, eval/ood/start/pass@k, eval/ood/start/mean@n, eval/ood/start/format, eval/ood/start/reward, eval/ood/start/clipped_ratio, eval/ood/start/solution_logp, eval/ood/start/problems, eval/ood/start/seconds | `eval.at_start`: the same, of the policy before its first update (the base: LoRA starts as the identity), logged at step 0 |

Entropy is compared in two ways, each with one name here, in `python -m qerl_exp.probe` and on the
results pages, which always say whose tokens: the **on-policy entropy gain** is one sampler's
`sampler/entropy` minus another's, each on its own rollouts (two runs at one step, e.g. a 4-bit row
against full precision at step 0: `analysis.compare`'s dose; the entropy QeRL credits with
exploration, its Fig. 5); the **same-token entropy gain** is two models' entropies on one sampler's
tokens (`entropy_gain`: the sampler's tokens; the probe: full precision's). The two differ: a
sampler that wanders onto tokens where every model is unsure has a higher on-policy entropy even
when both models score those tokens alike.

Every `tracker.completions_every` steps, `completions.jsonl` (beside `metrics.jsonl`) gets one JSON
object per completion of the step (`completion_records`): `step`, `prompt` (as the model saw it,
chat template applied), `completion`, `rewards` (each reward function's value, unweighted; null
where it returned None), `reward` (their weighted sum; null when none applies), `advantage`, and
`extra` when reward functions logged columns (`log_extra(column, values)`: `{column: value}`).

Summary keys (`summary.json`, `run_summary`): `reward/final` (mean reward over the last quarter of the
steps, `FINAL_FRACTION`; the console line and the sweep's default objective use the same window;
null, as `reward/best`, when no reward function scored any completion), `reward/best`, `<metric>/mean` for entropy, speed and noise metrics, the last `eval/*`, the largest
`mem/*`, `steps` (the run loop adds `world_size`, `commit` and `device`, `cpu` or `cuda`, and for a
task that reads data `data/train_prompts`, `data/held_out_prompts` and `data/duplicate_prompts`, the
rows that repeat an earlier row's prompt: `tasks.datasets.FileTask.facts`); for the embedded model, its warm-up: `warmup/greedy_accuracy`, `warmup/steps` and
`warmup/weights` (a digest of the weights: runs that show the same one started from the same model;
another kind of CPU can warm up another, `models.warmup.weights_digest`); for a two-route task
(`task=fork`), what its warm-up measured, `warmup/pi0_b` (the base's mean probability of opening
with route B), `warmup/pi0_b_max` (its largest over the probe's prompts), `warmup/accuracy_a` and
`warmup/accuracy_b` (each route's greedy accuracy with the route given), and `fork/first_b_step`,
the first step that sampled route B (-1: none did).
"""

from __future__ import annotations

import difflib
import math
import re
import resource
import sys

import numpy as np
import torch

from qerl_exp.config.splits import HELD_OUT, OOD

# What a two-route task's warm-up measured (`rl.routes.route_facts`), kept in summary.json as `warmup/<fact>`.
ROUTE_FACTS = ("pi0_b", "pi0_b_max", "accuracy_a", "accuracy_b")

# A run's final score is the mean of a metric over the last quarter of its steps: in summary.json
# (`reward/final`), on the console line, and as the sweep's default objective.
FINAL_FRACTION = 0.25


class Phase:
    """The phases of an RL step, by name: each is timed (`timing_s/NAME`), the rollout and learner
    get a memory peak (`mem/NAME_peak_bytes`), and an out-of-memory error names the phase it hit."""

    ROLLOUT = "rollout"
    REFERENCE = "reference"
    MONITOR = "monitor"
    LEARNER = "learner"
    OPTIMIZER = "optimizer"
    SYNC = "sync"  # bringing a separate sampler up to the updated policy (re-quantization)


# Where each evaluation split's metrics are logged (`eval_prefix`).
_SPLIT_PREFIX = {HELD_OUT: "eval/", OOD: "eval/ood/"}

# Prefixes of the metrics that measure the machine rather than the run (wall times, process and
# device peaks): two runs with the same seed agree on everything else.
MACHINE_METRICS = ("perf/", "timing_s/", "mem/peak_bytes", f"mem/{Phase.ROLLOUT}_peak_bytes",
                   f"mem/{Phase.LEARNER}_peak_bytes", "mem/load_peak_bytes",
                   *(f"{prefix}{start}seconds" for prefix in _SPLIT_PREFIX.values() for start in ("", "start/")))


def _logged_patterns() -> list[str]:
    """The per-step names of this module's table (its first column), as regular expressions:
    `<fn>` is any reward function's name, `<name>` any name it logs, `@k` / `@n` any count."""
    names = []
    for line in __doc__.split("Summary keys")[0].splitlines():
        cells = line.split("|")
        if len(cells) > 2 and cells[1].strip() not in ("name", "---"):
            names += [n.strip() for n in cells[1].split(",")]
    return [re.escape(n).replace("<fn>", "[^/]+").replace("<name>", "[^/]+").replace("@k", r"@\d+").replace("@n", r"@\d+")
            for n in names]


LOGGED = _logged_patterns()


def check_logged(name: str) -> None:
    """Raise `ValueError` with one line unless `name` is a per-step metric of the table above.

    Args:
        name: a metric name as a sweep objective or a figure would read it from `metrics.jsonl`.
    """
    if not any(re.fullmatch(p, name) for p in LOGGED):
        plain = [p.replace("\\", "") for p in LOGGED if "[" not in p and "\\d" not in p]
        close = difflib.get_close_matches(name, plain, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; the names are listed in qerl_exp/rl/metrics.py"
        raise ValueError(f"no run logs a metric named {name!r}{hint}")


def token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is 1 (0 when the mask is empty)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits) over the last dim; pass logits already divided by T."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(r) - r - 1, r = ref_logp - logp; >= 0."""
    r = ref_logp - logp
    return torch.exp(r) - r - 1


def kl_full(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-position exact KL(reference || policy) over the vocabulary, from tempered logits."""
    ref_logp = torch.log_softmax(ref_logits.float(), dim=-1)
    logp = torch.log_softmax(logits.float(), dim=-1)
    return (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1)


def kl_metric(logp: torch.Tensor, ref_logp: torch.Tensor | None, mask: torch.Tensor) -> dict[str, float]:
    """`kl` against the reference; nothing on steps without a reference pass (`monitor.kl_every`)."""
    return {} if ref_logp is None else {"kl": token_mean(kl_k3(logp.detach(), ref_logp), mask).item()}


def total_reward(rewards: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """Each completion's reward `[B]`: the weighted sum of the functions' values (`rewards[fn]`,
    `[B]`, NaN where `fn` returned None) that apply to it; NaN where none applies (TRL's
    "unscorable" completion, which the advantages and the reward metrics leave out)."""
    total = 0
    for name, r in rewards.items():
        total = total + torch.nan_to_num(r, nan=0.0) * weights[name]
    unscored = torch.stack([r.isnan() for r in rewards.values()]).all(dim=0)
    return torch.where(unscored, torch.nan, total)


def _nanmean(x: torch.Tensor) -> float:
    """The mean of the values that are not NaN (NaN when there is none)."""
    kept = x[~x.isnan()]
    return kept.mean().item() if kept.numel() else math.nan


def _nanstd(x: torch.Tensor) -> float:
    """The sample std of the values that are not NaN (NaN when there are fewer than two)."""
    kept = x[~x.isnan()]
    return kept.std().item() if kept.numel() > 1 else math.nan


def reward_metrics(rewards: dict[str, torch.Tensor], weights: dict[str, float], group_size: int) -> dict[str, float]:
    """Reward statistics of a batch; `rewards[fn]` is `[B]` (NaN where `fn` returned None) with each
    group's rows adjacent; `weights[fn]` its weight in the reward."""
    total = total_reward(rewards, weights)
    groups = total.view(-1, group_size)
    # rows no function applies to are left out; without any, the plain reductions (the same numbers)
    stds = torch.tensor([_nanstd(g) for g in groups]) if total.isnan().any() else groups.std(dim=1)
    out = {
        "reward": _nanmean(total),
        "reward_std": _nanstd(total),
        "reward_group_std": stds.mean().item(),
        "frac_reward_zero_std": (stds == 0).float().mean().item(),
    }
    for name, r in rewards.items():
        out.update({f"rewards/{name}/mean": _nanmean(r), f"rewards/{name}/std": _nanstd(r)})
    return out


def completion_records(step: int, prompts: list[str], completions: list[str], rewards: dict[str, list[float]],
                       total: list[float], advantages: list[float], extra: dict[str, list] | None = None) -> list[dict]:
    """The rows of `completions.jsonl` (the module doc): one per completion, NaN written as null;
    `extra`: the columns reward functions logged (`log_extra`), one value per completion."""
    def value(v: float) -> float | None:
        return None if math.isnan(v) else v

    return [{"step": step, "prompt": prompt, "completion": completion,
             "rewards": {name: value(values[i]) for name, values in rewards.items()},
             "reward": value(total[i]), "advantage": advantages[i],
             **({"extra": {c: _plain(v[i]) for c, v in extra.items()}} if extra else {})}
            for i, (prompt, completion) in enumerate(zip(prompts, completions))]


def _plain(value):
    """A logged value as JSON holds it: numbers, text, booleans and None as they are, anything else as text."""
    if value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value)):
        return value
    return str(value)


def logged_metrics(logs: list[dict[str, list[float]]]) -> dict[str, float]:
    """`rewards/<fn>/<name>`: the mean of what reward function `fn` logged as `name` (`log_metric`) in
    the step, over every call and rank (`logs`: each rank's values by metric)."""
    names = sorted({name for log in logs for name in log})
    return {name: float(np.mean([v for log in logs for v in log.get(name, [])])) for name in names}


def epoch_metrics(epoch: float) -> dict[str, float]:
    """`epoch`: the passes over the training prompts drawn so far (TRL's fractional epoch)."""
    return {"epoch": epoch}


def completion_metrics(mask: torch.Tensor, terminated: torch.Tensor) -> dict[str, float]:
    return {
        "completions/mean_length": mask.sum(dim=1).float().mean().item(),
        "completions/clipped_ratio": (~terminated).float().mean().item(),
    }


def clip_metrics(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, eps_low: float, eps_high: float) -> dict[str, float]:
    """How often the clipped objective bound; `advantages` broadcast over tokens."""
    low = (ratio < 1 - eps_low) & (advantages < 0)
    high = (ratio > 1 + eps_high) & (advantages > 0)
    return {"clip_ratio/low_mean": token_mean(low.float(), mask).item(), "clip_ratio/high_mean": token_mean(high.float(), mask).item()}


def monitor_metrics(
    sampler_entropy: torch.Tensor,
    sampler_logits: torch.Tensor,
    ref_logits: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, float]:
    """The noise monitor: the sampler against the full-precision reference.

    `ref_logits` and `sampler_logits` are `[B, T, V]` tempered logits on the sampled tokens'
    positions; `sampler_logits` comes from re-scoring the batch with the sampler (noise on).
    """
    ref_entropy = entropy_from_logits(ref_logits)
    return {
        "entropy_gain": (token_mean(sampler_entropy, mask) - token_mean(ref_entropy, mask)).item(),
        "quant/kl": token_mean(kl_full(ref_logits, sampler_logits), mask).item(),
    }


def logp_gap_metric(sampler_logp: torch.Tensor, learner_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the sampler (quantized, noisy) and the learner (clean) disagree on the sampled tokens."""
    return {"sampling/logp_gap": token_mean((sampler_logp - learner_logp).abs(), mask).item()}


def entropy_metrics(learner_entropy: torch.Tensor, sampler_entropy: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    return {
        "entropy": token_mean(learner_entropy.detach(), mask).item(),
        "sampler/entropy": token_mean(sampler_entropy, mask).item(),
    }


def noise_metrics(sigma: float, stage: int, scales: list[float]) -> dict[str, float]:
    """The schedule's sigma and stage, and the noise's standard deviation per noised norm
    (`sigma * scale`, `scales` from `noise.AQN.scales`: 1 for absolute noise) as its spread."""
    effective = sigma * np.asarray(scales or [0.0], dtype=np.float64)  # no noised norm: no noise anywhere
    return {"noise/sigma": sigma, "noise/stage": stage, "noise/sigma_eff_min": float(effective.min()),
            "noise/sigma_eff_median": float(np.median(effective)), "noise/sigma_eff_max": float(effective.max())}


def perf_metrics(completion_tokens: int, step_s: float, phases: dict[str, float]) -> dict[str, float]:
    """Throughput and the step's wall time, whole and by phase (`phases` in seconds, by name)."""
    out = {"perf/rollout_tok_s": completion_tokens / max(phases[Phase.ROLLOUT], 1e-9), "perf/step_s": step_s}
    out.update({f"timing_s/{name}": seconds for name, seconds in phases.items()})
    return out


def optim_metrics(loss: float, grad_norm: float, lr: float, skipped: bool) -> dict[str, float]:
    """`train/skipped` is 1 when the step's loss or gradient was not finite and no update was made."""
    return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "train/skipped": float(skipped)}


def memory_metrics(weights: dict[str, int], device: torch.device, rollout_bytes: int, load_peak: int,
                   peaks: dict[str, int]) -> dict[str, float]:
    """`weights` from `qerl_exp.quant.memory_bytes`, the rollout engine's own bytes, the peak while
    the models were built, and this step's peak per phase (`peaks`, from `phase_peak_bytes`)."""
    out = {**weights, "mem/rollout_bytes": rollout_bytes, "mem/load_peak_bytes": load_peak,
           "mem/peak_bytes": max(peaks.values())}
    out.update({f"mem/{phase}_peak_bytes": value for phase, value in peaks.items()})
    return out


def phase_peak_bytes(device: torch.device) -> int:
    """Peak allocated CUDA memory since the last call (the counter restarts), or on CPU the peak
    resident set size of the process so far (which cannot restart)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def step_metrics(
    *,
    rewards: dict[str, torch.Tensor],
    weights: dict[str, float],
    group_size: int,
    mask: torch.Tensor,
    terminated: torch.Tensor,
    sampler_logp: torch.Tensor,
    sampler_entropy: torch.Tensor,
    learner_logp: torch.Tensor,
    learner_entropy: torch.Tensor,
    ref_logp: torch.Tensor | None,
    clip: dict[str, float],
    loss: float,
    grad_norm: float,
    lr: float,
    skipped: bool,
    sigma: float,
    stage: int,
    noise_scales: list[float],
    memory: dict[str, float],
    step_s: float,
    phases: dict[str, float],
) -> dict[str, float]:
    """Every metric of one RL step but the monitor's and the evaluation's, from the step's tensors.

    Args:
        rewards: `[B]` per reward function (NaN where it returned None), each group's rows adjacent.
        weights: each reward function's weight.
        group_size: completions per prompt.
        mask: `[B, T]` completion tokens.
        terminated: `[B]` completions that ended with EOS or a stop string.
        sampler_logp: `[B, T]` log-probs under the policy that sampled (quantized, noisy).
        sampler_entropy: `[B, T]` its entropies.
        learner_logp: `[B, T]` the learner's log-probs before the update.
        learner_entropy: `[B, T]` its entropies.
        ref_logp: `[B, T]` the reference policy's (the base without LoRA); None on steps without a
            reference pass (no `kl`).
        clip: the update's clip counters (`clip_metrics` over every update).
        loss: the optimized loss. grad_norm: the grad norm before clipping. lr: the learning rate.
        skipped: the update was skipped for a non-finite loss or gradient.
        sigma: this step's AQN sigma. stage: its stage. noise_scales: each noised norm's factor on
            sigma (`noise.AQN.scales`).
        memory: from `memory_metrics`.
        step_s: wall time of the step. phases: seconds per phase (`perf_metrics`).

    Returns:
        The metrics, by name.
    """
    return {
        **reward_metrics(rewards, weights, group_size),
        **completion_metrics(mask, terminated),
        **clip,
        **kl_metric(learner_logp, ref_logp, mask),
        **entropy_metrics(learner_entropy, sampler_entropy, mask),
        **logp_gap_metric(sampler_logp, learner_logp, mask),
        **noise_metrics(sigma, stage, noise_scales),
        **optim_metrics(loss, grad_norm, lr, skipped),
        **memory,
        **perf_metrics(int(mask.sum()), step_s, phases),
    }


def final_window(steps: int, fraction: float = FINAL_FRACTION) -> int:
    """How many trailing steps a final score averages for a run of `steps` steps."""
    return max(1, min(steps, math.ceil(fraction * steps - 1e-9)))


def noise_controller_metrics(target_error: float, target: float) -> dict[str, float]:
    """The adaptive noise controller's set point, and the set point minus its measurement (nan when
    not measured)."""
    return {"noise/target_error": target_error, "noise/target": target}


def eval_prefix(split: str, start: bool = False) -> str:
    """The prefix of an evaluation's metric names: `eval/` for the held-out split, `eval/ood/` for
    the out-of-template one; then `start/` for the evaluation before the first update."""
    return _SPLIT_PREFIX[split] + ("start/" if start else "")


def eval_metrics(is_correct: list[bool], in_format: list[bool], rewards: list[float], terminated: list[bool],
                 solution_logp: torch.Tensor, counts: list[int], n: int, k: int, seconds: float,
                 prefix: str = "eval/") -> dict[str, float]:
    """Held-out evaluation: greedy pass@1 (`is_correct`, `in_format`, `rewards`, `terminated` per problem,
    from the greedy completion; `is_correct` and `in_format` empty, and their metrics NaN, when the
    run has no `correct` or `format` function; a NaN reward is one no function applies to), the
    reference solutions' mean log-prob, and, when `k`, the unbiased pass@k and mean@n from `counts`
    (correct samples of `n` per problem); names start with `prefix` (`eval_prefix`)."""
    def mean(values: list) -> float:  # NaN when nothing was judged (the run has no such function)
        values = [v for v in values if not math.isnan(v)]
        return float(np.mean(values)) if values else math.nan

    out = {
        "pass@1": mean(is_correct),
        "format": mean(in_format),
        "reward": mean(rewards),
        "clipped_ratio": float(1 - np.mean(terminated)),
        "solution_logp": float(solution_logp.mean()),
        "problems": float(len(terminated)),  # one per problem graded, whatever functions judge them
    }
    if k:
        out[f"pass@{k}"] = mean([pass_at_k(n, c, k) for c in counts])
        out[f"mean@{n}"] = float(np.sum(counts) / (n * len(counts))) if counts else math.nan
    out["seconds"] = seconds
    return {prefix + name: value for name, value in out.items()}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from `n` samples of which `c` are correct.

    The probability that at least one of `k` samples drawn without replacement from the `n` is
    correct: `1 - C(n - c, k) / C(n, k)` (Chen et al. 2021, "Evaluating Large Language Models
    Trained on Code").

    Args:
        n: samples drawn for the problem.
        c: correct samples among them.
        k: the k of pass@k; at most `n`.

    Returns:
        The estimate in [0, 1].

    Example:
        >>> pass_at_k(n=4, c=1, k=2)
        0.5
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def run_summary(history: list[dict[str, float]], base: dict) -> dict[str, float | str]:
    """`summary.json` from the per-step metrics: the final reward (mean over the last
    `FINAL_FRACTION` of the steps) and the best, the means of entropy, speed and noise metrics, the
    last evaluation, the largest memory figures, and the embedded model's warm-up (`base`:
    `models.warmup.load_or_warm_up`'s info; empty for a pretrained model): its greedy accuracy, its
    steps and the digest of the weights it ended with."""
    def series(name):
        return [h[name] for h in history if isinstance(h.get(name), (int, float)) and math.isfinite(h[name])]

    rewards = series("reward")  # none where no reward function ever scored a completion: NaN (null in summary.json)
    out = {"steps": len(history),
           "reward/final": float(np.mean(rewards[-final_window(len(rewards)):])) if rewards else math.nan,
           "reward/best": float(np.max(rewards)) if rewards else math.nan}
    for name in ("entropy", "sampler/entropy", "entropy_gain", "quant/kl", "perf/rollout_tok_s", "perf/step_s"):
        values = series(name)
        if values:
            out[f"{name}/mean"] = float(np.mean(values))
    for name in sorted({k for h in history for k in h if k.startswith("eval/")}):
        values = series(name)
        if values:
            out[name] = values[-1]
    for name in sorted({k for h in history for k in h if k.startswith("mem/")}):
        values = series(name)
        if values:
            out[name] = float(max(values))
    out["warmup/greedy_accuracy"] = base.get("greedy_accuracy", float("nan"))
    if "weights" in base:
        out["warmup/steps"], out["warmup/weights"] = base["steps"], base["weights"]
    out.update({f"warmup/{k}": base[k] for k in ROUTE_FACTS if k in base})
    shares = [(h["step"], h["fork/b_share"]) for h in history if h.get("fork/b_share") is not None]
    if shares:
        out["fork/first_b_step"] = next((step for step, share in shares if share > 0), -1)
    return out
