"""The clipped policy-gradient loss of the learner, from advantages to one micro-batch's share.

The loss follows TRL's `GRPOTrainer` under TRL's option names (`AlgoConfig`; `docs/losses.md`
writes each out): advantages centred within each group and scaled by the group's or the batch's
reward std or not at all (`scale_rewards`); a clipped surrogate with one importance ratio per token
or, GSPO's, per completion (`importance_sampling_level`); four aggregations of the token losses
(`loss_type`: grpo, dr_grpo, dapo, bnpo). GRPO and DAPO (the `algo` presets) differ in those
fields, the clip range (DAPO's clip-higher) and the dropping of groups with zero reward spread and
of truncated completions. The k3 KL term and the entropy bonus are off by default, as in QeRL; the
KL is measured either way.

The log-probs it takes come from the one scorer, `qerl_exp.decoders.scoring`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qerl_exp.config import AlgoConfig
from qerl_exp.rl.metrics import kl_k3


def _nan_mean_std(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and Bessel-corrected std `[n, 1]` of each row of `x`, NaN entries left out."""
    scored = ~x.isnan()
    if scored.all():
        return x.mean(dim=1, keepdim=True), x.std(dim=1, keepdim=True)
    count = scored.sum(dim=1, keepdim=True)
    mean = x.nansum(dim=1, keepdim=True) / count
    return mean, (((x - mean) ** 2).nansum(dim=1, keepdim=True) / (count - 1)).sqrt()


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str,
                     batch_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """`r - mean_group`, divided by `std + 1e-4` of the `group`, of the `batch` or by nothing (`none`),
    as TRL's `scale_rewards`; `[B]` with groups adjacent. `batch_rewards`: the whole batch's rewards
    (every rank's) for `batch`; default `rewards`. Stds are Bessel-corrected, as torch's and TRL's.
    A NaN reward (a completion no reward function applies to) is left out of every mean and std,
    and its advantage is 0, as in TRL."""
    groups = rewards.view(-1, group_size)
    mean, std = _nan_mean_std(groups)
    adv = groups - mean
    if scale == "group":
        adv = adv / (std + 1e-4)
    elif scale == "batch":
        adv = adv / (_nan_mean_std((rewards if batch_rewards is None else batch_rewards).view(1, -1))[1] + 1e-4)
    return torch.nan_to_num(adv.reshape(-1), nan=0.0)


def tokens_in_loss(completion_mask: torch.Tensor, terminated: torch.Tensor, rewards: torch.Tensor,
                   algo: AlgoConfig) -> torch.Tensor:
    """The tokens `[B, T]` that count in the loss: the completions' own, less the groups whose rewards
    are all equal (`filter_zero_std`) and the completions cut at the length cap
    (`mask_truncated_completions`; `terminated` `[B]`: ended by EOS or a stop string)."""
    keep = torch.ones_like(terminated, dtype=completion_mask.dtype)
    if algo.filter_zero_std:
        keep = keep * (_nan_mean_std(rewards.view(-1, algo.group_size))[1][:, 0] > 0).repeat_interleave(algo.group_size)
    if algo.mask_truncated_completions:
        keep = keep * terminated
    return completion_mask * keep.unsqueeze(1)


def loss_normalizer(mask: torch.Tensor, algo: AlgoConfig, total: Callable[[float], float] = float,
                    world_size: int = 1) -> float:
    """The denominator of `aggregate` over a whole (mini-)batch, so that its micro-batches' shares
    sum to the batch's loss and the ranks' gradients, summed, to the whole batch's gradient.

    Args:
        mask: `[B, T]` this rank's rows of the mini-batch: the tokens that count in the loss.
        algo: `loss_type` picks the count: `grpo` the completions with a token in the loss, `dapo`
            the tokens, each over every rank; `bnpo` this rank's tokens times the number of ranks
            (each rank's token mean, averaged over ranks); `dr_grpo` every completion of every rank
            times `max_new_tokens`.
        total: sums a count over the ranks of a data-parallel run (`distributed.total`).
        world_size: the number of ranks.

    Returns:
        The count, at least 1.
    """
    if algo.loss_type == "grpo":
        count = total(float((mask.sum(dim=1) > 0).sum()))
    elif algo.loss_type == "dapo":
        count = total(float(mask.sum()))
    elif algo.loss_type == "bnpo":
        count = max(1.0, float(mask.sum())) * world_size
    else:  # dr_grpo
        count = total(float(mask.shape[0])) * algo.max_new_tokens
    return max(1.0, count)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, normalizer: float) -> torch.Tensor:
    """This micro-batch's share of the batch loss: `grpo` sums each completion's token mean, the other
    loss types sum the tokens' losses; over `loss_normalizer`'s count."""
    mask = mask.to(per_token.dtype)
    if loss_type != "grpo":
        return (per_token * mask).sum() / normalizer
    per_seq = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_seq.sum() / normalizer


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    algo: AlgoConfig,
    mask: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    sampler_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate (+ beta * KL estimate - entropy_coef * entropy), before aggregation.

    Args:
        logp: `[B, T]` learner log-probs of the sampled tokens (with grad).
        old_logp: `[B, T]` log-probs of the policy before this step's first update (no grad); the
            ratio exp(logp - old_logp) is exactly 1 in the first update.
        advantages: `[B]` group-normalized advantages.
        algo: the objective's settings.
        mask: `[B, T]` the tokens in the loss; needed when `algo.importance_sampling_level` is
            `sequence` (each completion's ratio is exp of the mean log-ratio over them).
        ref_logp: `[B, T]` reference-policy log-probs; needed when `algo.beta > 0`.
        entropy: `[B, T]` learner entropies (with grad); needed when `algo.entropy_coef > 0`.
        sampler_logp: `[B, T]` log-probs under the policy that sampled (quantized, noisy); needed
            when `algo.tis_cap > 0` (truncated importance weights min(pi_old / pi_sampler, cap), per token).

    Returns:
        `(per_token [B, T], ratio [B, T])`, the ratio the clip acts on (a completion's own at every
        token at sequence level); aggregate the first with `aggregate`.
    """
    adv = advantages.unsqueeze(1)
    log_ratio = logp - old_logp
    if algo.importance_sampling_level == "sequence":  # GSPO
        m = mask.to(log_ratio.dtype)
        log_ratio = ((log_ratio * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1)).expand_as(logp)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - algo.eps_low, 1 + algo.eps_high)
    per_token = torch.maximum(unclipped, clipped)
    if algo.tis_cap > 0:
        per_token = per_token * torch.exp(old_logp - sampler_logp).clamp(max=algo.tis_cap)
    if algo.beta > 0:
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + algo.beta * (kl * ratio if algo.kl_estimator == "k3_ratio" else kl)
    if algo.entropy_coef > 0:
        per_token = per_token - algo.entropy_coef * entropy
    return per_token, ratio.detach()
