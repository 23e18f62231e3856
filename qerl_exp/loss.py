"""The learner side: scoring completions with the policy and the clipped policy-gradient loss.

GRPO and DAPO differ only in fields of `AlgoConfig`: the clip range (DAPO's clip-higher,
eps_high 0.28), the loss aggregation (`sequence` for GRPO, `token` for DAPO) and whether groups
with zero reward spread are dropped. The k3 KL term and the entropy bonus are off by default, as in
QeRL; the KL is measured either way.
"""

from __future__ import annotations

import torch

from qerl_exp.config import AlgoConfig
from qerl_exp.metrics import clip_metrics, kl_k3
from qerl_exp.rollout import Rollout


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool) -> torch.Tensor:
    """`(r - mean_group) / (std_group + eps)` per completion; `[B]` with groups adjacent."""
    groups = rewards.view(-1, group_size)
    adv = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (groups.std(dim=1, keepdim=True) + 1e-4)
    return adv.reshape(-1)


def completion_logits(model, rollout: Rollout, temperature: float) -> torch.Tensor:
    """Tempered logits `[B, T, V]` that predict each completion token, teacher-forced."""
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], dim=1)
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    prompt_len, new = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    return logits[:, prompt_len - 1 : prompt_len - 1 + new].float() / temperature


def token_logp(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob `[B, T]` of `tokens` under softmax(logits)."""
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """`token`: mean over all tokens of the batch (DAPO). `sequence`: mean per completion, then
    over completions (GRPO)."""
    mask = mask.to(per_token.dtype)
    if how == "token":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    rows = mask.sum(dim=1) > 0
    per_seq = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_seq[rows].mean() if rows.any() else per_seq.sum() * 0


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    algo: AlgoConfig,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    sampler_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate (+ beta * k3 KL - entropy_coef * entropy), aggregated per `algo.loss_agg`.

    Args:
        logp: `[B, T]` learner log-probs of the sampled tokens (with grad).
        old_logp: `[B, T]` log-probs of the policy that the ratio is taken against (no grad).
        advantages: `[B]` group-normalized advantages.
        mask: `[B, T]` completion tokens that count.
        algo: the objective's settings.
        ref_logp: `[B, T]` reference-policy log-probs; needed when `algo.beta > 0`.
        entropy: `[B, T]` learner entropies (with grad); needed when `algo.entropy_coef > 0`.
        sampler_logp: `[B, T]` sampler log-probs of the sampled tokens; needed when
            `algo.tis_cap > 0` (truncated importance weights min(pi_old / pi_sampler, cap)).

    Returns:
        The scalar loss and its clip metrics.
    """
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - algo.eps_low, 1 + algo.eps_high)
    per_token = torch.maximum(unclipped, clipped)
    if algo.tis_cap > 0:
        per_token = per_token * torch.exp(old_logp - sampler_logp).clamp(max=algo.tis_cap)
    if algo.beta > 0:
        per_token = per_token + algo.beta * kl_k3(logp, ref_logp)
    if algo.entropy_coef > 0:
        per_token = per_token - algo.entropy_coef * entropy
    loss = aggregate(per_token, mask, algo.loss_agg)
    return loss, clip_metrics(ratio.detach(), adv.expand_as(ratio), mask, algo.eps_low, algo.eps_high)

