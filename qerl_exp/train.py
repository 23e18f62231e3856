"""The QeRL run loop: one readable function, `run`.

Per step, data flows one way:
  prompts -> rollout from the sampler (quantized base + LoRA, AQN on) -> rewards -> group
  advantages -> learner forward (AQN off) -> monitor (reference vs sampler) -> loss, backward,
  optimizer step -> metrics -> trackers.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from qerl_exp import metrics as M
from qerl_exp import checkpoint
from qerl_exp.checkpoint import restore_rng, rng_state
from qerl_exp.config import Config, QuantConfig, as_dict
from qerl_exp.eval import evaluate
from qerl_exp.loss import completion_logits, group_advantages, policy_loss, token_logp
from qerl_exp.model import build_models, requantize_sampler, resolve_device, resolve_dtype, sync_lora
from qerl_exp.noise import AQN, Schedule
from qerl_exp.quant import memory_bytes
from qerl_exp.rollout import make_sampler, sample
from qerl_exp.tasks import build_task
from qerl_exp.tracking import Tracker, run_tags

StepCallback = Callable[[int, dict[str, float]], None]


class RunExistsError(RuntimeError):
    """The run directory holds a finished run, which is never overwritten."""


def seed_everything(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def lr_lambda(total_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    """Linear warm-up over `warmup_ratio` of the steps, then cosine decay to 0."""
    warmup = int(total_steps * warmup_ratio)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * progress))

    return f


def summarize(history: list[dict[str, float]]) -> dict[str, float]:
    """Run summary from the per-step metrics: final (mean of the last 10%) and best reward, means."""
    def series(name):
        return [h[name] for h in history if isinstance(h.get(name), (int, float)) and math.isfinite(h[name])]

    rewards = series("reward")
    tail = rewards[-max(1, len(rewards) // 10):]
    out = {"steps": len(history), "reward/final": float(np.mean(tail)), "reward/best": float(np.max(rewards))}
    for name in ("entropy", "sampler/entropy", "entropy_gain", "quant/kl", "perf/rollout_tok_s", "perf/step_s"):
        values = series(name)
        if values:
            out[f"{name}/mean"] = float(np.mean(values))
    for name in sorted({k for h in history for k in h if k.startswith("eval/")}):
        values = series(name)
        if values:
            out[name] = values[-1]
    for name in ("mem/weights_bytes", "mem/quantized_linear_bytes", "mem/peak_bytes"):
        values = series(name)
        if values:
            out[name] = float(max(values))
    return out


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


def _open_run_dir(run_dir: Path, config: dict) -> tuple[Path, dict] | None:
    """Create the run directory, or find the checkpoint to resume an unfinished run from."""
    if (run_dir / "summary.json").exists():
        raise RunExistsError(f"{run_dir} holds a finished run; choose another run_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    found = checkpoint.latest(run_dir)
    if found is None:
        (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    return found


def _truncate_metrics(run_dir: Path, next_step: int) -> list[dict]:
    """Keep the logged steps before `next_step` (a resumed run logs the rest again); return them."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["step"] < next_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
    return rows


def run(
    cfg: Config,
    run_dir: Path,
    *,
    choices: dict[str, str] | None = None,
    group: str = "",
    on_step: StepCallback | None = None,
) -> dict[str, float]:
    """Train one policy with GRPO/DAPO from quantized rollouts and return its summary.

    A `run_dir` that holds an unfinished run is resumed from its newest readable checkpoint:
    model, optimizer, schedules, every RNG and the W&B run continue, and `metrics.jsonl` is
    truncated to that step, so the result equals an uninterrupted run with the same seed.

    Args:
        cfg: the validated run config.
        run_dir: the run directory (created if needed); a finished run's directory is refused.
        choices: the Hydra group choices (e.g. `{"quant": "nf4"}`), used for tags and names.
        group: the W&B group (a multirun or a sweep).
        on_step: called with `(step, metrics)` after each step; it may raise to stop the run
            (e.g. an Optuna pruner).

    Returns:
        The summary also written to `summary.json`.
    """
    run_dir = Path(run_dir)
    choices = choices or {}
    config = {**as_dict(cfg), "choices": choices}
    resume_from = _open_run_dir(run_dir, config)

    seed_everything(cfg.seed, cfg.train.deterministic)
    device = resolve_device(cfg.train.device)
    task = build_task(cfg.task)
    models = build_models(cfg, task, device)
    policy, tok, reference = models.policy, models.tokenizer, models.reference
    separate_sampler = models.sampler is not policy
    sampler_quant = QuantConfig(format=cfg.rollout.quant, targets=cfg.quant.targets)
    dtype = resolve_dtype(cfg.model.dtype, device)
    algo, G = cfg.algo, cfg.algo.group_size
    batch = cfg.train.prompts_per_step * G
    # The fast engine's static KV cache holds prompts of up to 1024 tokens plus the completion.
    sampler = make_sampler(cfg.rollout.engine, models.sampler, tok, device, batch, max_seq_len=1024 + algo.max_new_tokens)
    aqn = AQN(models.sampler, cfg.noise, seed=cfg.seed + 1)
    schedule = Schedule(cfg.noise, cfg.train.steps)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.train.steps, cfg.train.warmup_ratio))
    data_rng = np.random.default_rng(cfg.seed)
    weights = memory_bytes(policy)
    if separate_sampler:  # the rollout copy is memory the strategy pays for too
        sampler_bytes = memory_bytes(models.sampler)
        weights = {k: weights[k] + sampler_bytes[k] for k in weights}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def state(next_step: int) -> dict:
        return {
            "step": next_step, "optimizer": opt.state_dict(), "lr_scheduler": lr_sched.state_dict(),
            "noise": schedule.state_dict(), "aqn_rng": aqn.generator.get_state(), "rng": rng_state(data_rng),
            "wandb_id": tracker.run_id, "nonfinite": nonfinite,
        }

    start, nonfinite, wandb_id, history = 0, 0, None, []
    if resume_from is not None:
        path, saved = resume_from
        checkpoint.load_adapter(policy, path / "adapter")
        opt.load_state_dict(saved["optimizer"])
        lr_sched.load_state_dict(saved["lr_scheduler"])
        schedule.load_state_dict(saved["noise"])
        aqn.generator.set_state(saved["aqn_rng"])
        restore_rng(saved["rng"], data_rng)
        start, nonfinite, wandb_id = saved["step"], saved["nonfinite"], saved["wandb_id"]
        if separate_sampler:
            requantize_sampler(policy, models.sampler, sampler_quant, dtype)
        print(f"resuming {run_dir} at step {start} from {path.name}", file=sys.stderr)
    history = _truncate_metrics(run_dir, start)

    tracker = Tracker(run_dir, cfg.tracker, {**config, "base": models.base_info}, name=run_dir.name,
                      group=group or cfg.task.name, job_type="train", tags=[*run_tags(choices), f"seed:{cfg.seed}"],
                      run_id=wandb_id)
    try:
        for step in range(start, cfg.train.steps):
            t_step = time.perf_counter()
            problems = task.sample(cfg.train.prompts_per_step, data_rng)
            prompts = [tok.render_prompt(p.question, cfg.task.system_prompt) for p in problems]

            # Rollout: the sampler with this step's noise draw in its norm scales.
            sigma, stage = schedule(step)
            aqn.draw(sigma)
            models.sampler.eval()
            t_roll = time.perf_counter()
            with aqn.applied(models.sampler):
                rollout = sample(sampler, tok, prompts, algo, device)
            rollout_s = time.perf_counter() - t_roll

            # Rewards and group-normalized advantages.
            repeated = [p for p in problems for _ in range(G)]
            rewards = {fn_name: torch.tensor([fn(text, p) for text, p in zip(rollout.texts, repeated)], device=device)
                       for fn_name, fn in task.rewards.items()}
            total = sum(rewards.values())
            advantages = group_advantages(total, G, algo.scale_rewards)
            mask = rollout.completion_mask
            loss_mask = mask
            if algo.filter_zero_std:
                informative = total.view(-1, G).std(dim=1) > 0
                loss_mask = mask * informative.repeat_interleave(G).unsqueeze(1)
            with torch.no_grad(), policy.disable_adapter():
                ref_logp = token_logp(completion_logits(policy, rollout, algo.temperature), rollout.completion_ids)

            # Learner: clean norm scales (unless noise.apply_to=both), forward and backward.
            policy.train()
            with aqn.applied(policy) if cfg.noise.apply_to == "both" else nullcontext():
                logits = completion_logits(policy, rollout, algo.temperature)
                logp = token_logp(logits, rollout.completion_ids)
                entropy = M.entropy_from_logits(logits)
                loss, clip = policy_loss(logp, logp.detach(), advantages, loss_mask, algo, ref_logp=ref_logp,
                                         entropy=entropy, sampler_logp=rollout.sampler_logp)
                opt.zero_grad(set_to_none=True)
                loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip or float("inf"))

            # Monitor before the update: the policy that sampled, against the reference.
            step_metrics: dict[str, float] = {}
            if reference is not None and step % cfg.monitor.every == 0:
                step_metrics.update(_monitor(policy, models.sampler, reference, aqn, rollout, logp.detach(), algo.temperature))

            lr = lr_sched.get_last_lr()[0]
            finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
            nonfinite = 0 if finite else nonfinite + 1
            if finite:
                opt.step()
            opt.zero_grad(set_to_none=True)
            lr_sched.step()
            if separate_sampler and finite:
                requantize_sampler(policy, models.sampler, sampler_quant, dtype)

            if cfg.eval.every and ((step + 1) % cfg.eval.every == 0 or step + 1 == cfg.train.steps):
                step_metrics.update(evaluate(
                    policy, tok, task, k=cfg.eval.k, n=cfg.eval.n, temperature=algo.temperature, top_p=algo.top_p,
                    max_new_tokens=cfg.eval.max_new_tokens or algo.max_new_tokens,
                    batch_size=cfg.eval.batch_size, seed=cfg.seed, system_prompt=cfg.task.system_prompt))
            step_metrics.update(M.reward_metrics(rewards, G))
            step_metrics.update(M.completion_metrics(mask, rollout.terminated))
            step_metrics.update(clip)
            step_metrics.update(M.kl_metric(logp, ref_logp, mask))
            step_metrics.update(M.entropy_metrics(entropy, rollout.sampler_entropy, mask))
            step_metrics.update(M.noise_metrics(sigma, stage))
            step_metrics.update(M.optim_metrics(loss.item(), grad_norm.item(), lr, skipped=not finite))
            step_metrics.update(M.memory_metrics(weights, device))
            step_metrics.update(M.perf_metrics(int(mask.sum()), rollout_s, time.perf_counter() - t_step))
            step_metrics.update(schedule.observe(step_metrics))
            tracker.log(step, step_metrics)
            history.append({"step": step, **step_metrics})
            if cfg.tracker.completions_every and step % cfg.tracker.completions_every == 0:
                tracker.log_completions(step, [(prompts[i // G], rollout.texts[i], total[i].item()) for i in range(0, batch, G)])
            if nonfinite >= cfg.train.max_nonfinite:
                raise NonFiniteError(
                    f"{nonfinite} consecutive steps with a non-finite loss or gradient (last at step {step}); "
                    f"lower train.lr or check the data; the last good checkpoint is kept in {run_dir / 'checkpoints'}"
                )
            if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0 and step + 1 < cfg.train.steps:
                checkpoint.save(checkpoint.step_dir(run_dir, step + 1), policy, state(step + 1))
                checkpoint.prune(run_dir, cfg.checkpoint.keep)
            if on_step is not None:
                on_step(step, step_metrics)

        checkpoint.save(run_dir / "final", policy, state(cfg.train.steps))
        summary = {**summarize(history), "warmup/greedy_accuracy": models.base_info.get("greedy_accuracy", float("nan"))}
        tracker.finish(summary)
        return summary
    except BaseException:
        tracker.abort()
        raise


@torch.no_grad()
def _monitor(policy, sampler, reference, aqn: AQN, rollout, learner_logp: torch.Tensor, temperature: float) -> dict[str, float]:
    """Reference (full-precision base + the same LoRA) vs the sampler, on the rollout batch."""
    sync_lora(policy, reference)
    reference.eval()
    ref_logits = completion_logits(reference, rollout, temperature)
    with aqn.applied():
        sampler_logits = completion_logits(sampler, rollout, temperature)
    return M.monitor_metrics(rollout.sampler_logp, rollout.sampler_entropy, sampler_logits, ref_logits,
                             learner_logp, rollout.completion_mask)
