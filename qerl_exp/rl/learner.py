"""The policy update of one RL step: old log-probs, iterations, mini-batches, micro-batches.

What the ratio is taken against, in QeRL's setting: three policies score the sampled tokens.
- the *sampler* (behaviour policy): the quantized base + LoRA with this step's AQN draw in its norm
  scales; its log-probs come with the rollout (`Rollout.sampler_logp`).
- the *old* policy: the learner (the same quantized base + LoRA, clean norm scales) before this
  step's first update. With `algo.num_iterations == 1` and one mini-batch it is the learner itself,
  so the PPO ratio is exactly 1 and the clip never acts (GRPO as QeRL runs it); otherwise its
  log-probs are taken once, without grad, before the first update.
- the *learner*: the policy being optimised, re-scored in every update.
The ratio is learner / old. TIS (`algo.tis_cap`) corrects the remaining sampler / old mismatch
(noise, a separately quantized sampler) with weights min(old / sampler, cap).

Each update accumulates gradients over micro-batches, each scored by `scoring.score`: with
`train.padding_free` (the default), rows packed up to `train.micro_batch_tokens` tokens and run
through `qerl_exp.decoders.padding_free`; otherwise `train.micro_batch_size` left-padded rows through the HF
forward. The
loss is normalised by a count over the whole mini-batch (`loss.loss_normalizer`: its tokens, its
completions, or its completions times `max_new_tokens`, by `algo.loss_type`), and a row is never
split (GSPO's ratio is a whole completion's), so the gradient equals that of one pass over the
mini-batch. In a data-parallel run (`qerl_exp.run.distributed`) each rank
holds its share of every mini-batch: the normaliser counts all ranks' tokens, the gradients are
summed over the ranks before clipping, and the loss and clip counters cover every rank's tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from qerl_exp.config import AlgoConfig, TrainConfig
from qerl_exp.decoders import packing, padding_free
from qerl_exp.decoders.batch import Rollout, Sequences
from qerl_exp.decoders.scoring import score
from qerl_exp.rl.loss import aggregate, loss_normalizer, policy_loss
from qerl_exp.rl.metrics import clip_metrics
from qerl_exp.run import distributed

# Attention kernels of the learner's forward and backward. Not cuDNN's: on torch 2.11 with an H100/H200
# its backward returns NaN dQ when the length is 64 mod 128 and a query row is fully masked, which every
# left-padded prompt's padding rows are (pytorch/pytorch#196678; SmolLM2 runs skipped every step whose
# micro-batch was 64 + 128 tokens long). The others are exact there.
LEARNER_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class Update:
    """What one RL step's policy update did.

    Args:
        loss: mean over the optimizer steps of the optimized loss.
        grad_norm: mean over the optimizer steps of the global grad norm before clipping.
        skipped: optimizer steps skipped for a non-finite loss or gradient.
        steps: optimizer steps taken or skipped (num_iterations * mini_batches).
        logp: `[B, T]` learner log-probs before the first update (the old policy's).
        entropy: `[B, T]` learner entropies before the first update.
        clip: the clip counters over every token of every update (`metrics.clip_metrics`).
        ratio_dev: per optimizer step, the largest |ratio - 1| over its tokens.
        learner_s: seconds in forward and backward passes (old log-probs included).
        optimizer_s: seconds in the gradients' all-reduce (data-parallel runs), gradient clipping and
            optimizer steps.
    """

    loss: float
    grad_norm: float
    skipped: int
    steps: int
    logp: torch.Tensor
    entropy: torch.Tensor
    clip: dict[str, float]
    ratio_dev: list[float] = field(default_factory=list)
    learner_s: float = 0.0
    optimizer_s: float = 0.0


def clock(device: torch.device) -> float:
    """Wall time after the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def span(batch: Sequences, index: torch.Tensor) -> tuple[int, int]:
    """`(p0, t1)`: the first prompt column any of the rows `index` uses and their longest completion
    (read from `batch`'s masks: on the CPU, without waiting for the device)."""
    pm, cm = batch.prompt_mask[index], batch.completion_mask[index]
    p0 = int((pm.sum(0) > 0).nonzero().min()) if pm.any() else pm.shape[1] - 1
    return p0, int(cm.sum(1).max()) if cm.any() else 1


def rows(batch: Sequences, index: torch.Tensor, cut: tuple[int, int] | None = None) -> Sequences:
    """The rows `index` of a batch (a `Rollout` or its `Sequences`), without the padding columns none
    of them uses (`cut`: their `span`, when known)."""
    p0, t1 = cut if cut is not None else span(batch, index)
    part = dict(prompt_ids=batch.prompt_ids[index, p0:], prompt_mask=batch.prompt_mask[index, p0:],
                completion_ids=batch.completion_ids[index, :t1], completion_mask=batch.completion_mask[index, :t1])
    if isinstance(batch, Rollout):
        part.update(sampler_logp=batch.sampler_logp[index, :t1], sampler_entropy=batch.sampler_entropy[index, :t1],
                    terminated=batch.terminated[index], texts=[batch.texts[i] for i in index.tolist()])
    return type(batch)(**part)


def on_host(batch: Sequences) -> Sequences:
    """The batch's ids and masks on the CPU, for planning and packing micro-batches without a wait
    for the device at each one."""
    return Sequences(batch.prompt_ids.cpu(), batch.prompt_mask.cpu(), batch.completion_ids.cpu(),
                     batch.completion_mask.cpu())


def chunks(index: torch.Tensor, size: int) -> list[torch.Tensor]:
    """`index` in pieces of `size` rows (0: one piece)."""
    return list(index.split(size)) if size > 0 else [index]


def micro_batches(host: Sequences, index: torch.Tensor, train: TrainConfig) -> list[torch.Tensor]:
    """The learner's micro-batches of the rows `index` (CPU) of a batch (`host`: `on_host`'s copy):
    by packed tokens when padding-free, else by rows."""
    if train.padding_free:
        return packing.plan(host, index, train.micro_batch_tokens, train.shared_prefix)
    return chunks(index, train.micro_batch_size)


def score_all(policy, rollout: Rollout, temperature: float, train: TrainConfig,
              adapter: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies `[B, T]` of a whole batch, micro-batch by micro-batch, without grad."""
    b, t = rollout.completion_ids.shape
    logp = rollout.sampler_logp.new_zeros(b, t)
    entropy = torch.zeros_like(logp)
    host = on_host(rollout)
    with torch.no_grad(), padding_free.same_adapters():
        for idx in micro_batches(host, torch.arange(b), train):
            cut = span(host, idx)
            lp, ent = score(policy, rows(rollout, idx, cut), temperature, train, adapter=adapter, host=rows(host, idx, cut))
            logp[idx, : lp.shape[1]] = lp
            entropy[idx, : ent.shape[1]] = ent
    return logp, entropy


@sdpa_kernel(LEARNER_ATTENTION)  # forward, backward, and the forwards that checkpointing reruns in backward
def update_policy(
    policy,
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    rollout: Rollout,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    algo: AlgoConfig,
    train: TrainConfig,
    ref_logp: torch.Tensor | None = None,
) -> Update:
    """Run `algo.num_iterations` x `algo.mini_batches` optimizer steps on one rollout batch.

    Args:
        policy: the peft model; only `params` are updated.
        optimizer: the optimizer over `params`.
        params: the trainable parameters (for clipping the global grad norm).
        rollout: the step's completions (each row's sampler log-probs included).
        advantages: `[B]` group-normalized advantages.
        loss_mask: `[B, T]` tokens that count in the loss (the completion mask, minus filtered
            groups).
        algo: the objective.
        train: the micro-batching, the scorer (`padding_free` and its settings) and `grad_clip`.
        ref_logp: `[B, T]` reference log-probs; needed when `algo.beta > 0`.

    Returns:
        An `Update`. A non-finite loss or gradient skips that optimizer step (no parameter change).
    """
    b, t = rollout.completion_ids.shape
    device = advantages.device
    t0, optimizer_s = clock(device), 0.0
    reuse = algo.num_iterations > 1 or algo.mini_batches > 1
    if reuse:  # the old policy's log-probs, once, before any update
        old_logp, old_entropy = score_all(policy, rollout, algo.temperature, train)
    else:
        old_logp, old_entropy = torch.zeros(b, t, device=device), torch.zeros(b, t, device=device)
    losses, norms, ratio_dev, ratios = [], [], [], []
    skipped = 0
    host = on_host(rollout)  # micro-batches are planned, cut and packed from it: no wait for the GPU in between
    for _ in range(algo.num_iterations):
        for mini in torch.arange(b).chunk(algo.mini_batches):
            normalizer = loss_normalizer(loss_mask[mini], algo, distributed.total, distributed.world_size())
            optimizer.zero_grad(set_to_none=True)
            loss, dev = _accumulate(policy, rollout, host, mini, advantages, loss_mask, normalizer, algo, train,
                                    ref_logp, (old_logp, old_entropy), not reuse, ratios)
            t_opt = clock(device)
            grad_norm, stepped = _optimizer_step(optimizer, params, loss, train.grad_clip)
            skipped += not stepped
            optimizer_s += clock(device) - t_opt
            losses.append(loss)
            norms.append(grad_norm)
            ratio_dev.append(dev)
    ratio_all = distributed.gather(torch.cat([r[on] for r, on, _ in ratios]))
    adv_all = distributed.gather(torch.cat([a.unsqueeze(1).expand_as(r)[on] for r, on, a in ratios]))
    clip = clip_metrics(ratio_all, adv_all, torch.ones_like(ratio_all), algo.eps_low, algo.eps_high)
    return Update(
        loss=sum(losses) / len(losses), grad_norm=sum(norms) / len(norms), skipped=skipped,
        steps=len(losses), logp=old_logp, entropy=old_entropy, clip=clip, ratio_dev=ratio_dev,
        learner_s=clock(device) - t0 - optimizer_s, optimizer_s=optimizer_s,
    )


def _accumulate(policy, rollout: Rollout, host: Rollout, mini: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, normalizer, algo: AlgoConfig, train: TrainConfig,
                ref_logp: torch.Tensor | None, old: tuple[torch.Tensor, torch.Tensor], fill_old: bool,
                ratios: list) -> tuple[float, float]:
    """One mini-batch's gradients, accumulated micro-batch by micro-batch; its loss summed over ranks
    and the largest |ratio - 1| of its tokens over ranks. With `fill_old` (one update: the learner
    before it is the old policy) each micro-batch's log-probs and entropies are written into `old`;
    `ratios` gains each micro-batch's (ratios, tokens in the loss, advantages)."""
    old_logp, old_entropy = old
    device = advantages.device
    loss, dev = torch.zeros((), device=device), torch.zeros((), device=device)
    with padding_free.same_adapters():  # until optimizer.step
        for idx in micro_batches(host, mini, train):
            cut = span(host, idx)
            sub = rows(rollout, idx, cut)
            w = sub.completion_ids.shape[1]
            logp, entropy = score(policy, sub, algo.temperature, train, entropy_grad=algo.entropy_coef != 0,
                                  host=rows(host, idx, cut))
            if fill_old:
                old_logp[idx, :w], old_entropy[idx, :w] = logp.detach(), entropy.detach()
            mask = loss_mask[idx, :w]
            per_token, ratio = policy_loss(
                logp, old_logp[idx, :w], advantages[idx], algo, mask=mask,
                ref_logp=None if ref_logp is None else ref_logp[idx, :w], entropy=entropy,
                sampler_logp=sub.sampler_logp,
            )
            part = aggregate(per_token, mask, algo.loss_type, normalizer)
            part.backward()
            ratio, on = ratio.detach(), mask.bool()
            loss = loss + part.detach()
            dev = torch.maximum(dev, torch.where(on, (ratio - 1).abs(), 0).amax())
            ratios.append((ratio, on, advantages[idx]))
    return distributed.total(float(loss)), distributed.maximum({"dev": float(dev)})["dev"]


def _optimizer_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], loss: float,
                    grad_clip: float) -> tuple[float, bool]:
    """The gradients all-reduced over ranks and clipped (`grad_clip` 0: not clipped), then the step,
    skipped on a non-finite loss or gradient norm: (the gradient norm, whether it stepped)."""
    distributed.all_reduce_grads(params)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip or float("inf")))
    stepped = math.isfinite(loss) and math.isfinite(grad_norm)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped
