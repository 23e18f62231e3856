"""The QeRL run loop: one readable function, `run`.

Per step, data flows one way:
  prompts -> rollout from the sampler (quantized base + LoRA, AQN on) -> rewards -> group
  advantages -> learner forward (AQN off) -> monitor (reference vs sampler) -> loss, backward,
  optimizer step -> metrics -> trackers.

Under torchrun each rank runs this loop on its share of the step's prompts (`qerl_exp.run.distributed`
says what is global); the `distributed` calls below are no-ops in a one-process run.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from qerl_exp.config import Config, as_dict
from qerl_exp.decoders import blocks
from qerl_exp.decoders.batch import Rollout
from qerl_exp.decoders.scoring import completion_logits
from qerl_exp.eval import evaluate_in_training
from qerl_exp.models import Models, build_models, resolve_device, sync_lora
from qerl_exp.rl import metrics as M
from qerl_exp.rl import learner
from qerl_exp.rl.loss import group_advantages, tokens_in_loss
from qerl_exp.rl.noise import AQN, Schedule
from qerl_exp.rl.optim import make_optimizer, make_scheduler
from qerl_exp.rl.rollout import NonFiniteLogitsError, make_generator, row_seeds, sample
from qerl_exp.run import checkpoint, distributed, logs, progress, record, run_files, rundir
from qerl_exp.run.checkpoint import restore_rng, rng_state
from qerl_exp.run.signals import Interrupted, StopSignals
from qerl_exp.run.tracking import NoTracker, Tracker, logged_steps, run_tags, truncate_log
from qerl_exp.tasks import Task, build_task, duplicates_line
from qerl_exp.tasks.base import epochs_done
from qerl_exp.tasks.reward_funcs import trainer_state

StepCallback = Callable[[int, dict[str, float]], None]


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


def check_decoders(cfg: Config, task: Task, models: Models, generator, device: torch.device) -> None:
    """Before step 0: sample a short clean rollout (no noise) of two prompts from the sampler and
    score its tokens with the learner; stop the run unless their log-probs agree to rounding
    (`blocks.check_agreement`). Its prompts, seeds and passes draw from no stream of the run's.

    Raises:
        blocks.DecoderMismatch: one line naming the architecture, the gap and the fallback settings.
    """
    module, tok = models.sampler.module, models.tokenizer
    problems = task.sample(min(2, cfg.train.prompts_per_step), np.random.default_rng([cfg.seed, 2**31]))
    # unfiltered sampling: the sampler's log-probs are then the plain softmax's, as the learner's are
    algo = dataclasses.replace(cfg.algo, max_new_tokens=min(16, cfg.algo.max_new_tokens), top_p=1.0, top_k=0,
                               min_p=0.0, stop=[])
    prompts = [tok.render_prompt(p.prompt, cfg.task.system_prompt) for p in problems]
    module.eval()
    try:
        rollout = sample(generator, tok, prompts, algo, device, seeds=row_seeds(cfg.seed, 2**31, range(len(prompts)),
                                                                             algo.group_size))
    except NonFiniteLogitsError:  # nothing to compare; the loop's own guard takes such steps
        return
    logp, _ = learner.score_all(module, rollout, algo.temperature, cfg.train)
    gap = blocks.logp_gap(rollout.sampler_logp, logp, rollout.completion_mask)
    blocks.check_agreement(module, gap, distributed.any_rank)


def run(
    cfg: Config,
    run_dir: Path | rundir.RunDir,
    *,
    choices: dict[str, str] | None = None,
    group: str = "",
    on_step: StepCallback | None = None,
    stop: StopSignals | None = None,
) -> dict[str, float]:
    """Train one policy with GRPO/DAPO from quantized rollouts and return its summary.

    A `run_dir` that holds an unfinished run is resumed from its newest readable checkpoint whose
    steps `metrics.jsonl` all holds: model, optimizer, schedules, every RNG and the W&B run
    continue, and `metrics.jsonl` and `completions.jsonl` are truncated to that step, so the result
    equals an uninterrupted run with the same seed.
    Under torchrun every rank calls `run`; rank 0 alone writes `run_dir`.

    Args:
        cfg: the validated run config.
        run_dir: the run directory (created if needed; a finished run's directory is refused), or
            one the caller has claimed (`distributed.claim` with `run_config(cfg, choices)`) and
            releases.
        choices: the Hydra group choices (e.g. `{"quant": "nf4"}`), used for tags and names.
        group: the W&B group (a multirun or a sweep).
        on_step: called with `(step, metrics)` after each step; it may raise to stop the run
            (e.g. an Optuna pruner).
        stop: where stop requests come from: once its `signum` is set, the run finishes the step,
            checkpoints it and raises `signals.Interrupted`. None: this process's SIGINT and SIGTERM,
            caught for the run's steps; a sweep worker passes its own (in `graceful()` mode).

    Returns:
        The summary also written to `summary.json`.

    Raises:
        rundir.RunDirError: `run_dir` is finished, owned by another process, or holds a run with
            another config (see `rundir.claim`), or its checkpoint does (`rundir.check_checkpoint`);
            nothing was written.
        signals.Interrupted: SIGINT or SIGTERM stopped the run (after checkpointing its last step,
            when it had time to finish that step).
    """
    choices = choices or {}
    if isinstance(run_dir, rundir.RunDir):
        return _resume_and_train(cfg, run_dir.path, run_dir.record, choices, group, on_step, stop)
    config = run_config(cfg, choices, rundir.saved_config(run_dir))
    with distributed.claim(run_dir, config) as owned:
        return _resume_and_train(cfg, owned.path, config, choices, group, on_step, stop)


def _resume_and_train(cfg: Config, run_dir: Path, config: dict, choices: dict[str, str], group: str,
                      on_step: StepCallback | None, stop: StopSignals | None) -> dict[str, float]:
    # rank 0 reads the log, every rank its checkpoint: all resume at the same step
    resume_from = checkpoint.latest(run_dir, distributed.broadcast(logged_steps(run_dir) if distributed.is_main() else None))
    if resume_from is not None:  # its record's digests, as it made them
        saved = resume_from[1].get("config")
        rundir.check_checkpoint(resume_from[0], saved, run_files.comparable(saved, config))
    return _train(cfg, run_dir, config, resume_from, choices, group, on_step, stop)


def run_config(cfg: Config, choices: dict[str, str], saved: dict | None = None) -> dict:
    """What `config.json` records: the config, the Hydra choices, the data-parallel world size, the
    code's commit, and the digests of the files the run uses (`run_files.digests`), as the run's
    record `saved` (when there is one) made them (`run_files.comparable`)."""
    return run_files.comparable(saved, {**as_dict(cfg), "choices": choices, "world_size": distributed.world_size(),
                                        "commit": record.source_commit(), **run_files.digests(cfg)})


@dataclass
class _Loop:
    """What the run loop carries from step to step (`_setup` builds it)."""

    cfg: Config
    run_dir: Path
    config: dict
    device: torch.device
    task: Task
    models: Models
    generator: object  # the rollout engine over models.sampler.module (`make_generator`)
    aqn: AQN
    schedule: Schedule
    params: list[torch.Tensor]
    opt: torch.optim.Optimizer
    lr_sched: torch.optim.lr_scheduler.LRScheduler
    data_rng: np.random.Generator
    weights: dict[str, int]
    load_peak: float
    start: int = 0
    nonfinite: int = 0
    tracker: Tracker | NoTracker = field(default_factory=NoTracker)
    history: list[dict] = field(default_factory=list)


@dataclass
class _Batch:
    """One step's prompts and what the sampler made of them (`rollout` None: non-finite logits)."""

    problems: list
    prompts: list[str]
    rollout: Rollout | None
    sigma: float
    stage: int
    seconds: float


def _train(cfg: Config, run_dir: Path, config: dict, resume_from: tuple[Path, dict] | None, choices: dict[str, str],
           group: str, on_step: StepCallback | None, stop: StopSignals | None) -> dict[str, float]:
    """The body of `run`, in a run directory this process owns: set up, then one step after another."""
    loop = _setup(cfg, run_dir, config, resume_from, choices, group)
    models = loop.models
    # Where the run began, before any update (the policy as built: LoRA is the identity); logged at step 0.
    start_eval = evaluate_in_training(models.policy, models.tokenizer, loop.task, cfg, start=True,
                                      state=trainer_state(0, cfg.train.steps, 0.0)) \
        if cfg.eval.at_start and loop.start == 0 else {}
    bar = progress.Progress(cfg.train.steps, "train", initial=loop.start, file=distributed.console())
    signals = StopSignals() if stop is None else None
    stop = signals if signals is not None else stop
    try:
        with stop.graceful():
            for step in range(loop.start, cfg.train.steps):
                _step(loop, step, start_eval if step == 0 else {}, bar, on_step, stop)
        _save(loop, run_dir / "final", cfg.train.steps)
        summary = distributed.broadcast({**M.run_summary(loop.history, models.base_info), **getattr(loop.task, "facts", {}),
                                         "world_size": distributed.world_size(), "commit": record.source_commit(),
                                         "device": loop.device.type}
                                        if distributed.is_main() else None)
        loop.tracker.finish(summary)
        return summary
    except BaseException as e:
        bar.close()
        loop.tracker.abort()
        if isinstance(e, distributed.CollectiveError) and stop.signum:
            # torchrun (or the user) is stopping this rank: its peers' silence is that, not a hang
            raise Interrupted(stop.signum) from e
        raise
    finally:
        if signals is not None:
            signals.restore()


def _step(loop: _Loop, step: int, start_eval: dict[str, float], bar: progress.Progress, on_step: StepCallback | None,
          stop: StopSignals) -> None:
    """One step: rollout, learning (or a skip), checkpoints, the step hook, a stop request heeded."""
    cfg, run_dir = loop.cfg, loop.run_dir
    t_step = time.perf_counter()
    batch = _rollout(loop, step)
    if distributed.any_rank(batch.rollout is None):  # blown-up weights or noise: skipped, as for a NaN loss
        _skip(loop, step)
        return
    step_metrics = _learn(loop, step, batch, dict(start_eval), t_step)
    bar.update(step + 1, step_metrics)
    loop.history.append({"step": step, **step_metrics})
    _check_nonfinite(loop.nonfinite, cfg, step, run_dir)
    if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0 and step + 1 < cfg.train.steps:
        _save(loop, checkpoint.step_dir(run_dir, step + 1), step + 1, prune=True)
    if on_step is not None:
        on_step(step, step_metrics)
    signum = int(distributed.any_rank(stop.signum))  # every rank stops after the same step
    if signum and step + 1 < cfg.train.steps:  # SIGINT/SIGTERM: keep this step, then stop
        _save(loop, checkpoint.step_dir(run_dir, step + 1), step + 1)
        raise Interrupted(signum, step + 1)


def _setup(cfg: Config, run_dir: Path, config: dict, resume_from: tuple[Path, dict] | None, choices: dict[str, str],
           group: str) -> _Loop:
    """Seeds, models, the rollout engine, AQN and its schedule, the optimizer and its schedule, the
    data stream; restored from `resume_from` when given; the tracker and the logged history."""
    checkpoint.seed_everything(cfg.seed, cfg.train.deterministic)
    device = resolve_device(cfg.train.device)
    task = build_task(cfg.task, seed=cfg.seed)
    if distributed.is_main() and (line := duplicates_line(cfg.task, task)):
        print(line, file=sys.stderr)
    with logs.quiet(cfg.verbose):
        models = build_models(cfg, task, device)
    policy, sampling = models.policy, models.sampler.module
    rows = len(distributed.shard(cfg.train.prompts_per_step)) * cfg.algo.group_size
    generator = make_generator(cfg.rollout.engine, sampling, models.tokenizer, device, rows, cfg.algo.max_new_tokens)
    if not cfg.train.padding_free and cfg.train.gradient_checkpointing == "true":  # the padding-free learner checkpoints itself
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    aqn = AQN(sampling, cfg.noise, seed=cfg.seed + 1)
    if distributed.is_main() and (warning := aqn.scale_warning()):
        print(warning, file=sys.stderr)
    params = [p for p in policy.parameters() if p.requires_grad]
    with logs.quiet(cfg.verbose):  # bitsandbytes' import notices, for its 8-bit AdamW
        opt = make_optimizer(params, cfg.train, device)
    loop = _Loop(cfg, run_dir, config, device, task, models, generator, aqn, Schedule(cfg.noise, cfg.train.steps), params,
                 opt, make_scheduler(opt, cfg.train),
                 np.random.default_rng(cfg.seed), models.sampler.weights_bytes(), M.phase_peak_bytes(device))
    if resume_from is None:
        check_decoders(cfg, task, models, generator, device)
    wandb_id = None
    if resume_from is not None:
        path, saved = resume_from
        checkpoint.load_adapter(policy, path / "adapter")
        opt.load_state_dict(saved["optimizer"])
        loop.lr_sched.load_state_dict(saved["lr_scheduler"])
        loop.schedule.load_state_dict(saved["noise"])
        aqn.generator.set_state(saved["aqn_rng"])
        restore_rng(saved["rng"], loop.data_rng)
        loop.start, loop.nonfinite, wandb_id = saved["step"], saved["nonfinite"], saved["wandb_id"]
        models.sampler.sync()
        if distributed.is_main():
            print(f"resuming {run_dir} at step {loop.start} from {path.name}", file=sys.stderr)
    if distributed.is_main():  # rank 0 logs and prints for every rank
        loop.history = truncate_log(run_dir, loop.start)
        truncate_log(run_dir, loop.start, "completions.jsonl")
        loop.tracker = Tracker(run_dir, cfg.tracker, {**config, "base": models.base_info}, name=run_dir.name,
                               group=group or cfg.task.name, job_type="train",
                               tags=[*run_tags(choices, cfg.model.name), f"seed:{cfg.seed}"], run_id=wandb_id)
    return loop


def _save(loop: _Loop, path: Path, next_step: int, prune: bool = False) -> None:
    """Rank 0 writes the checkpoint: every rank holds the same policy and optimizer state."""
    if not distributed.is_main():
        return
    state = {
        "step": next_step, "optimizer": loop.opt.state_dict(), "lr_scheduler": loop.lr_sched.state_dict(),
        "noise": loop.schedule.state_dict(), "aqn_rng": loop.aqn.generator.get_state(), "rng": rng_state(loop.data_rng),
        "wandb_id": loop.tracker.run_id, "nonfinite": loop.nonfinite, "config": loop.config,
    }
    checkpoint.save(path, loop.models.policy, state)
    if prune:
        checkpoint.prune(loop.run_dir, loop.cfg.checkpoint.keep)


def _rollout(loop: _Loop, step: int) -> _Batch:
    """The step's prompts (every rank draws them from one stream and keeps its share), sampled with
    this step's noise draw in the sampler's norm scales."""
    cfg, tok, sampling = loop.cfg, loop.models.tokenizer, loop.models.sampler.module
    share = distributed.shard(cfg.train.prompts_per_step)
    drawn = step * cfg.train.prompts_per_step if cfg.task.sampler == "epoch" else None  # the epoch sampler's position
    problems = loop.task.sample(cfg.train.prompts_per_step, loop.data_rng, start=drawn)[share.start:share.stop]
    prompts = [tok.render_prompt(p.prompt, cfg.task.system_prompt) for p in problems]
    sigma, stage = loop.schedule(step)
    loop.aqn.draw(sigma)
    sampling.eval()
    t0 = time.perf_counter()
    try:
        with _phase(M.Phase.ROLLOUT), loop.aqn.applied(sampling):
            rollout = sample(loop.generator, tok, prompts, cfg.algo, loop.device, ignore_eos=cfg.rollout.ignore_eos,
                             seeds=row_seeds(cfg.seed, step, share, cfg.algo.group_size), lengths=cfg.rollout.lengths)
    except NonFiniteLogitsError:
        rollout = None
    return _Batch(problems, prompts, rollout, sigma, stage, time.perf_counter() - t0)  # sample() synchronised


def _skip(loop: _Loop, step: int) -> None:
    """A step whose rollout had non-finite logits: no update, counted as a non-finite step."""
    loop.nonfinite += 1
    loop.lr_sched.step()
    loop.tracker.log(step, M.optim_metrics(math.nan, math.nan, loop.lr_sched.get_last_lr()[0], skipped=True))
    loop.history.append({"step": step, "train/skipped": 1})
    _check_nonfinite(loop.nonfinite, loop.cfg, step, loop.run_dir)


def _learn(loop: _Loop, step: int, batch: _Batch, metrics: dict[str, float], t_step: float) -> dict[str, float]:
    """After the rollout: rewards and advantages, the reference and monitor passes, the update, the
    sampler's sync, an evaluation when due; the step's metrics (added to `metrics`), logged."""
    cfg, device, models = loop.cfg, loop.device, loop.models
    rollout_bytes = getattr(loop.generator, "nbytes", 0)
    if hasattr(loop.generator, "release"):
        loop.generator.release()
    peaks = {M.Phase.ROLLOUT: M.phase_peak_bytes(device)}
    scored = _rewards(loop, step, batch)
    ref_logp, reference_s = _reference(loop, step, batch.rollout)
    monitor_s = _monitored(loop, step, batch.rollout, metrics)
    update, peaks[M.Phase.LEARNER] = _update(loop, batch.rollout, scored, ref_logp)
    lr, finite = loop.lr_sched.get_last_lr()[0], update.skipped == 0
    loop.nonfinite = 0 if finite else loop.nonfinite + 1
    loop.lr_sched.step()
    t0 = learner.clock(device)
    if finite:
        models.sampler.sync()
    sync_s = learner.clock(device) - t0
    if cfg.eval.every and ((step + 1) % cfg.eval.every == 0 or step + 1 == cfg.train.steps):
        metrics.update(evaluate_in_training(models.policy, models.tokenizer, loop.task, cfg,
                                            state=trainer_state(step + 1, cfg.train.steps, _epoch(loop, step + 1))))
    # the slowest rank's times
    phases = distributed.maximum({M.Phase.ROLLOUT: batch.seconds, M.Phase.REFERENCE: reference_s,
                                  M.Phase.MONITOR: monitor_s, M.Phase.LEARNER: update.learner_s,
                                  M.Phase.OPTIMIZER: update.optimizer_s, M.Phase.SYNC: sync_s,
                                  "step": time.perf_counter() - t_step})
    metrics.update(_batch_metrics(loop, batch, scored, update, ref_logp, lr, phases, rollout_bytes, peaks))
    _log(loop, step, batch, scored, metrics)
    return metrics


@dataclass
class _Scored:
    """One step's rewards: each function's values (`scores`, NaN where it does not apply; `rewards`
    as tensors), their weighted sum, the group-normalized advantages, the tokens in the loss, and what
    the functions logged (`log_metric`, `log_extra`)."""

    scores: dict[str, list[float]]
    rewards: dict[str, torch.Tensor]
    total: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    logged: dict
    extra: dict


def _rewards(loop: _Loop, step: int, batch: _Batch) -> _Scored:
    """Rewards (each function's values, NaN where it does not apply) and group-normalized advantages."""
    cfg, algo, G, rollout = loop.cfg, loop.cfg.algo, loop.cfg.algo.group_size, batch.rollout
    repeated = [p for p in batch.problems for _ in range(G)]
    ids = [row[m].tolist() for row, m in zip(rollout.completion_ids.cpu(), rollout.completion_mask.bool().cpu())]
    scores = loop.task.rewards.compute(repeated, rollout.texts, f"step {step}", completion_ids=ids,
                                       state=trainer_state(step, cfg.train.steps, _epoch(loop, step)))
    # what the functions logged (`log_metric`, `log_extra`), kept before an evaluation's calls replace it
    logged, extra = loop.task.rewards.logged, loop.task.rewards.extra
    rewards = {name: torch.tensor(values, device=loop.device) for name, values in scores.items()}
    total = M.total_reward(rewards, loop.task.rewards.weights)
    advantages = group_advantages(total, G, algo.scale_rewards,
                                  distributed.gather(total) if algo.scale_rewards == "batch" else None)
    loss_mask = tokens_in_loss(rollout.completion_mask, rollout.terminated, total, algo)
    return _Scored(scores, rewards, total, advantages, loss_mask, logged, extra)


def _reference(loop: _Loop, step: int, rollout: Rollout) -> tuple[torch.Tensor | None, float]:
    """The reference (the base without LoRA) on the rollout, and its seconds: for the loss when
    beta > 0, else only every monitor.kl_every steps, for the `kl` metric."""
    cfg, device = loop.cfg, loop.device
    if not (cfg.algo.beta > 0 or (cfg.monitor.kl_every and step % cfg.monitor.kl_every == 0)):
        return None, 0.0
    t0 = learner.clock(device)
    with _phase(M.Phase.REFERENCE):
        ref_logp, _ = learner.score_all(loop.models.policy, rollout, cfg.algo.temperature, cfg.train, adapter=False)
    return ref_logp, learner.clock(device) - t0


def _monitored(loop: _Loop, step: int, rollout: Rollout, metrics: dict[str, float]) -> float:
    """Monitor before the update, every monitor.every steps: the policy that sampled, against the
    full-precision reference (its metrics added to `metrics`); its seconds."""
    cfg, models = loop.cfg, loop.models
    t0 = learner.clock(loop.device)
    if models.reference is not None and step % cfg.monitor.every == 0:
        with _phase(M.Phase.MONITOR):
            metrics.update(distributed.weighted_mean(
                _monitor(models.policy, models.sampler.module, models.reference, loop.aqn, rollout,
                         cfg.algo.temperature, cfg.train.micro_batch_size), float(rollout.completion_mask.sum())))
    return learner.clock(loop.device) - t0


def _update(loop: _Loop, rollout: Rollout, scored: _Scored, ref_logp: torch.Tensor | None) -> tuple[learner.Update, int]:
    """The learner: clean norm scales (unless noise.apply_to=both), forward and backward, optimizer
    step; the update and the phase's peak memory (the reference and monitor passes included)."""
    cfg, policy = loop.cfg, loop.models.policy
    policy.train()
    with _phase(M.Phase.LEARNER), loop.aqn.applied(policy) if cfg.noise.apply_to == "both" else nullcontext():
        update = learner.update_policy(policy, loop.opt, loop.params, rollout, scored.advantages, scored.loss_mask,
                                       cfg.algo, cfg.train, ref_logp=ref_logp)
    return update, M.phase_peak_bytes(loop.device)


def _batch_metrics(loop: _Loop, batch: _Batch, scored: _Scored, update: learner.Update, ref_logp: torch.Tensor | None,
                   lr: float, phases: dict[str, float], rollout_bytes: int, peaks: dict) -> dict[str, float]:
    """Metrics of the whole batch (every rank's rows; the slowest rank's times, the largest peaks)."""
    rollout, gather = batch.rollout, distributed.gather
    return M.step_metrics(
        rewards={name: gather(r) for name, r in scored.rewards.items()}, weights=loop.task.rewards.weights,
        group_size=loop.cfg.algo.group_size, mask=gather(rollout.completion_mask),
        terminated=gather(rollout.terminated), sampler_logp=gather(rollout.sampler_logp),
        sampler_entropy=gather(rollout.sampler_entropy), learner_logp=gather(update.logp),
        learner_entropy=gather(update.entropy), ref_logp=None if ref_logp is None else gather(ref_logp),
        clip=update.clip, loss=update.loss, grad_norm=update.grad_norm, lr=lr, skipped=update.skipped != 0,
        sigma=batch.sigma, stage=batch.stage, noise_scales=loop.aqn.scales,
        memory=distributed.maximum(M.memory_metrics(loop.weights, loop.device, rollout_bytes, loop.load_peak, peaks)),
        step_s=phases.pop("step"), phases=phases,
    )


def _log(loop: _Loop, step: int, batch: _Batch, scored: _Scored, metrics: dict[str, float]) -> None:
    """The task's and the reward functions' own metrics, the data's progress and the noise schedule's
    observation added to `metrics`, then logged, with the completions when due."""
    cfg, G, rollout = loop.cfg, loop.cfg.algo.group_size, batch.rollout
    if hasattr(loop.task, "step_metrics"):  # a task's own metrics (task=fork: the route each completion took)
        metrics.update(loop.task.step_metrics(distributed.gather_objects(rollout.texts),
                                              distributed.gather(rollout.sampler_entropy[:, 0]).tolist()))
    # what the reward functions logged (`log_metric`: every rank's values), and how far through the data
    metrics.update(M.logged_metrics(distributed.gather_objects([scored.logged])))
    if hasattr(loop.task, "epoch"):
        metrics.update(M.epoch_metrics(_epoch(loop, step + 1)))
    metrics.update(loop.schedule.observe(metrics))
    if distributed.is_main() and (warning := loop.schedule.pinned_warning()):
        print(warning, file=sys.stderr)
    loop.tracker.log(step, metrics)
    if cfg.tracker.completions_every and step % cfg.tracker.completions_every == 0:
        loop.tracker.log_completions(step, distributed.gather_objects(M.completion_records(
            step, [batch.prompts[i // G] for i in range(len(rollout.texts))], rollout.texts, scored.scores,
            scored.total.tolist(), scored.advantages.tolist(), scored.extra)))


def _epoch(loop: _Loop, step: int) -> float:
    return epochs_done(loop.task, step, loop.cfg.train.prompts_per_step, loop.cfg.train.steps)


def _check_nonfinite(nonfinite: int, cfg: Config, step: int, run_dir: Path) -> None:
    if nonfinite >= cfg.train.max_nonfinite:
        raise NonFiniteError(
            f"{nonfinite} consecutive steps with non-finite logits, loss or gradient (last at step {step}); "
            f"lower train.lr (now {cfg.train.lr:g}) or the noise sigma, or check the data; "
            f"the last good checkpoint is kept in {run_dir / 'checkpoints'}")


@torch.no_grad()
def _monitor(policy, sampler, reference, aqn: AQN, rollout, temperature: float, micro: int) -> dict[str, float]:
    """Reference (full-precision base + the same LoRA) vs the sampler, on the rollout batch, `micro`
    completions at a time (0: all at once): the full-vocabulary logits of a whole batch are several
    GiB (64 x 128 tokens x 49k fp32 is 1.5 GiB a copy). Token means of the parts, weighted by their
    tokens, are the batch's."""
    sync_lora(policy, reference)
    reference.eval()
    total, out = max(1.0, float(rollout.completion_mask.sum())), {}
    for idx in learner.chunks(torch.arange(len(rollout.texts), device=rollout.completion_mask.device), micro):
        sub = learner.rows(rollout, idx)
        tokens = float(sub.completion_mask.sum())
        ref_logits = completion_logits(reference, sub, temperature)
        with aqn.applied():
            sampler_logits = completion_logits(sampler, sub, temperature)
        part = M.monitor_metrics(sub.sampler_entropy, sampler_logits, ref_logits, sub.completion_mask)
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v * tokens / total
    return out


class OutOfMemory(RuntimeError):
    """CUDA ran out of memory; the message names the phase and the settings that lower it."""


_LOWER = {
    M.Phase.ROLLOUT: "lower train.prompts_per_step, algo.group_size or algo.max_new_tokens",
    M.Phase.REFERENCE: "lower train.micro_batch_tokens (padding-free) or train.micro_batch_size",
    M.Phase.MONITOR: "set train.micro_batch_size (the monitor scores that many completions at a time) or "
                     "monitor.every=0 (the full-precision reference doubles the weights)",
    M.Phase.LEARNER: "lower train.micro_batch_tokens (padding-free; train.micro_batch_size otherwise), set "
                     "train.gradient_checkpointing=true, or lower algo.max_new_tokens",
}


@contextmanager
def _phase(name: str):
    """Turn a CUDA out-of-memory error inside a phase into one line naming the phase and the fix."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise OutOfMemory(f"CUDA out of memory in the {name} phase; {_LOWER[name]}") from None
