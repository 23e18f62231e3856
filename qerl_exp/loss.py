"""The learner side: scoring completions with the policy and the clipped policy-gradient loss.

The loss follows TRL's `GRPOTrainer` under TRL's option names (`AlgoConfig`; `docs/losses.md`
writes each out): advantages centred within each group and scaled by the group's or the batch's
reward std or not at all (`scale_rewards`); a clipped surrogate with one importance ratio per token
or, GSPO's, per completion (`importance_sampling_level`); four aggregations of the token losses
(`loss_type`: grpo, dr_grpo, dapo, bnpo). GRPO and DAPO (the `algo` presets) differ in those
fields, the clip range (DAPO's clip-higher) and the dropping of groups with zero reward spread and
of truncated completions. The k3 KL term and the entropy bonus are off by default, as in QeRL; the
KL is measured either way.

Scoring never materialises [B, T, vocabulary] logits: `score_completions` runs the decoder to its
hidden states and applies the LM head to `LOGIT_CHUNK` elements' worth of completion tokens at a
time, each chunk checkpointed (its fp32 logits are recomputed in backward, not kept).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from qerl_exp.config import AlgoConfig
from qerl_exp.metrics import kl_k3
from qerl_exp.batch import Sequences

LOGIT_CHUNK = 2**26  # fp32 logits per chunk (256 MB): 441 tokens at Qwen's 152,064-token vocabulary


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


def _model_inputs(batch: Sequences) -> dict[str, torch.Tensor]:
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    # Prompts are left-padded: positions count real tokens only.
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}


def _hidden_states(model, batch: Sequences):
    """The teacher-forced decoder pass every score starts from: `(head, hidden [B, P + T, H])`, the
    HF causal LM's output layer and its decoder's last hidden states (any family: its `base_model`,
    `model` in Llama's, `transformer` in GPT-2's), the LM inside a peft wrapper or the model itself."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return lm.get_output_embeddings(), lm.base_model(**_model_inputs(batch)).last_hidden_state


def completion_logits(model, batch: Sequences, temperature: float) -> torch.Tensor:
    """Tempered logits `[B, T, V]` that predict each completion token, teacher-forced: the whole
    vocabulary at every position, for the monitor's exact KL (small models; the learner and
    evaluation use `score_completions`)."""
    head, hidden = _hidden_states(model, batch)
    prompt_len, new = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    return head(hidden)[:, prompt_len - 1 : prompt_len - 1 + new].float() / temperature


def token_logp(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob `[B, T]` of `tokens` under softmax(logits)."""
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _chunk_scores(hidden: torch.Tensor, tokens: torch.Tensor, lm_head, temperature: float, entropy_grad: bool):
    logp_all = torch.log_softmax(lm_head(hidden).float() / temperature, dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    # An entropy with grad saves two [chunk, V] fp32 tensors per chunk that backward frees only
    # if the loss uses the entropy; as a metric it would keep them all until backward ends.
    p = logp_all if entropy_grad else logp_all.detach()
    entropy = -(p.exp() * p).sum(dim=-1)
    return logp, entropy


def score_completions(
    model, batch: Sequences, temperature: float, entropy_grad: bool = False, chunk: int = LOGIT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs and entropies of the completion tokens, in chunks of the vocabulary:
    the one scorer of the learner (`learner`) and of evaluation (`eval.solution_logprobs`).

    Equal to `token_logp(completion_logits(...))` and `entropy_from_logits(completion_logits(...))`
    on the completion tokens, without ever holding more than `chunk` fp32 logits (times a few for
    softmax), in forward or in backward.

    Args:
        model: the policy (a peft model or a plain HF causal LM of the Llama/Qwen2 family).
        batch: a `Rollout` or other `Sequences`; only positions with `completion_mask == 1` are scored.
        temperature: logits are divided by it.
        entropy_grad: whether the entropy is differentiable (an entropy bonus in the loss); else it
            is a metric and keeps no activations for backward.
        chunk: most logits (tokens x vocabulary) per chunk.

    Returns:
        `(logp, entropy)`, each `[B, T]` fp32, 0 where the completion mask is 0; `logp` is
        differentiable when grad is enabled, `entropy` only with `entropy_grad`.
    """
    head, hidden = _hidden_states(model, batch)
    prompt_len, (b, t) = batch.prompt_ids.shape[1], batch.completion_ids.shape
    hidden = hidden[:, prompt_len - 1 : prompt_len - 1 + t].reshape(b * t, -1)
    where = batch.completion_mask.reshape(-1).nonzero().squeeze(1)
    logp, entropy = chunk_scores(hidden[where], batch.completion_ids.reshape(-1)[where], head, temperature,
                                 entropy_grad, chunk)
    zeros = hidden.new_zeros(b * t, dtype=torch.float32)
    return zeros.index_put((where,), logp).view(b, t), zeros.index_put((where,), entropy).view(b, t)


def chunk_scores(hidden: torch.Tensor, tokens: torch.Tensor, lm_head, temperature: float, entropy_grad: bool = False,
                 chunk: int = LOGIT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies `[M]` (fp32) of `tokens` `[M]` predicted from `hidden` `[M, H]`,
    `chunk // vocabulary` tokens at a time, each chunk checkpointed under grad (its logits are
    recomputed in backward, not kept): what both the padded and the padding-free scorer end in."""
    step = max(1, chunk // lm_head.out_features)
    logp, entropy = [], []
    for i in range(0, len(tokens), step):
        args = (hidden[i : i + step], tokens[i : i + step], lm_head, temperature, entropy_grad)
        lp, ent = checkpoint(_chunk_scores, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk_scores(*args)
        logp.append(lp)
        entropy.append(ent)
    if not logp:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logp), torch.cat(entropy)


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
