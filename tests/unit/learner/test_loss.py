"""Advantages and the clipped policy-gradient loss against hand computation, and each of TRL's loss
types against its published formula, written out independently (`trl_loss`)."""

from __future__ import annotations

import statistics

import pytest
import torch

from qerl_exp.config import LOSS_TYPES, AlgoConfig
from qerl_exp.rl.loss import aggregate, group_advantages, loss_normalizer, policy_loss, tokens_in_loss
from qerl_exp.rl.metrics import clip_metrics
from qerl_exp.rl.rollout import completion_mask


def _loss(logp, old, adv, mask, algo, **kw):
    per_token, ratio = policy_loss(logp, old, adv, algo, mask=mask, **kw)
    loss = aggregate(per_token, mask, algo.loss_type, loss_normalizer(mask, algo))
    return loss, clip_metrics(ratio, adv.unsqueeze(1).expand_as(ratio), mask, algo.eps_low, algo.eps_high)


def trl_loss(logp, old, adv, mask, algo: AlgoConfig, ranks: int = 1):
    """The objective of TRL's GRPOTrainer, written from its definitions, completion by completion:
    r_it = pi/pi_old per token, or GSPO's s_i = exp(mean_t log(pi/pi_old)) at every token;
    L_it = -min(r A_i, clip(r, 1 - eps_low, 1 + eps_high) A_i); then
    grpo: mean over completions with T_i > 0 of (1/T_i) sum_t L_it; bnpo and dapo (one rank): sum L /
    sum T_i; dr_grpo: sum L / (N * max_new_tokens). `ranks` > 1: rows split evenly over that many
    ranks, and bnpo the mean over ranks of each rank's sum L / sum T_i."""
    terms = []  # (row, the row's token losses)
    for i in range(logp.shape[0]):
        on = [t for t in range(logp.shape[1]) if mask[i, t]]
        if algo.importance_sampling_level == "sequence":
            s = torch.exp(sum(logp[i, t] - old[i, t] for t in on) / len(on)) if on else torch.ones((), dtype=logp.dtype)
            ratios = [s] * len(on)
        else:
            ratios = [torch.exp(logp[i, t] - old[i, t]) for t in on]
        low, high = 1 - algo.eps_low, 1 + algo.eps_high
        terms.append([-torch.minimum(r * adv[i], torch.clamp(r, low, high) * adv[i]) for r in ratios])
    if algo.loss_type == "grpo":
        means = [sum(ls) / len(ls) for ls in terms if ls]
        return sum(means) / len(means)
    if algo.loss_type == "dr_grpo":
        return sum(sum(ls) for ls in terms if ls) / (len(terms) * algo.max_new_tokens)
    if algo.loss_type == "dapo" or ranks == 1:
        return sum(sum(ls) for ls in terms if ls) / sum(len(ls) for ls in terms)
    per_rank = len(terms) // ranks  # bnpo
    shares = [terms[r * per_rank:(r + 1) * per_rank] for r in range(ranks)]
    return sum(sum(sum(ls) for ls in sh if ls) / max(1, sum(len(ls) for ls in sh)) for sh in shares) / ranks


def _fixed_inputs():
    """Six completions of up to 5 tokens: lengths 5, 3, 1, 4, 0 (nothing in the loss) and 2; log-ratios
    from -0.6 to 0.6, so that both clips act."""
    logp = torch.tensor([[-1.0, -0.5, -2.0, -0.1, -3.0], [-0.2, -1.5, -0.7, 0.0, 0.0], [-0.9, 0.0, 0.0, 0.0, 0.0],
                         [-2.2, -0.3, -1.1, -0.4, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0], [-0.6, -1.9, 0.0, 0.0, 0.0]])
    shift = torch.tensor([[0.3, -0.1, 0.6, -0.4, 0.05], [-0.6, 0.2, 0.25, 0.0, 0.0], [0.4, 0.0, 0.0, 0.0, 0.0],
                          [-0.2, 0.5, -0.3, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0], [0.35, -0.45, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    adv = torch.tensor([1.3, -0.7, 0.4, -1.1, 0.9, 0.6])
    return logp, logp - shift, adv, mask


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_equals_its_formula_in_value_and_gradient(loss_type, level):
    logp, old, adv, mask = _fixed_inputs()
    algo = AlgoConfig(loss_type=loss_type, importance_sampling_level=level, eps_low=0.2, eps_high=0.28, max_new_tokens=7)
    got_logp = logp.clone().requires_grad_()
    got, clip = _loss(got_logp, old, adv, mask, algo)
    got.backward()
    want_logp = logp.double().requires_grad_()
    want = trl_loss(want_logp, old.double(), adv.double(), mask, algo)
    want.backward()
    assert clip["clip_ratio/low_mean"] + clip["clip_ratio/high_mean"] > 0  # the clip acts on some tokens
    assert abs(got.item() - want.item()) < 1e-6
    torch.testing.assert_close(got_logp.grad.double(), want_logp.grad, rtol=0, atol=1e-6)


def test_the_loss_types_differ_where_their_formulas_do():
    logp, old, adv, mask = _fixed_inputs()
    values = {lt: _loss(logp, old, adv, mask, AlgoConfig(loss_type=lt, max_new_tokens=7))[0].item() for lt in LOSS_TYPES}
    assert len({round(v, 6) for v in values.values()}) == 3 and values["bnpo"] == values["dapo"]  # one process
    # GSPO: a completion's tokens share one ratio, so its tokens are clipped together
    _, ratio = policy_loss(logp, old, adv, AlgoConfig(importance_sampling_level="sequence"), mask=mask)
    want = torch.exp(((logp - old) * mask).sum(1) / mask.sum(1).clamp(min=1))
    torch.testing.assert_close(ratio, want[:, None].expand_as(ratio))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batch_and_rank_shares_sum_to_the_batch_loss(loss_type, level):
    """Micro-batches of one rank sum to its loss; two ranks' losses (their gradients are summed)
    sum to the formula's over both ranks' rows, bnpo's each rank's token mean averaged."""
    logp, old, adv, mask = _fixed_inputs()
    algo = AlgoConfig(loss_type=loss_type, importance_sampling_level=level, eps_high=0.28, max_new_tokens=7)
    per_token, _ = policy_loss(logp, old, adv, algo, mask=mask)
    norm = loss_normalizer(mask, algo)
    whole = aggregate(per_token, mask, loss_type, norm)
    parts = sum(aggregate(per_token[i:i + 2], mask[i:i + 2], loss_type, norm) for i in range(0, 6, 2))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)
    halves = [slice(0, 3), slice(3, 6)]
    counted = []  # each rank's own count, which distributed.total sums over the ranks
    for h in halves:
        loss_normalizer(mask[h], algo, lambda x: counted.append(x) or x, world_size=2)
    both = sum(counted)
    ranks = sum(aggregate(per_token[h], mask[h], loss_type, loss_normalizer(mask[h], algo, lambda x: both, world_size=2))
                for h in halves)
    want = trl_loss(logp.double(), old.double(), adv.double(), mask, algo, ranks=2)
    assert ranks.item() == pytest.approx(want.item(), abs=1e-6)


def test_scale_rewards_group_batch_and_none():
    r = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 9.0])
    centred = [1 - 2, 0, 3 - 2, 5 - 19 / 3, 5 - 19 / 3, 9 - 19 / 3]
    group_std = [statistics.stdev([1, 2, 3])] * 3 + [statistics.stdev([5, 5, 9])] * 3
    assert group_advantages(r, 3, "group").tolist() == pytest.approx([c / (s + 1e-4) for c, s in zip(centred, group_std)], rel=1e-6)
    batch_std = statistics.stdev(r.tolist())
    assert group_advantages(r, 3, "batch").tolist() == pytest.approx([c / (batch_std + 1e-4) for c in centred], rel=1e-6)
    assert group_advantages(r, 3, "none").tolist() == pytest.approx(centred, rel=1e-6)
    # over several ranks, `batch` takes the std of every rank's rewards
    wider = torch.tensor([0.0, 10.0, 20.0])
    got = group_advantages(r, 3, "batch", torch.cat([r, wider]))
    assert got.tolist() == pytest.approx([c / (statistics.stdev(r.tolist() + [0, 10, 20]) + 1e-4) for c in centred], rel=1e-6)


def test_tokens_in_loss_drop_zero_spread_groups_and_truncated_completions():
    mask = torch.ones(4, 3, dtype=torch.long)
    terminated = torch.tensor([True, False, True, True])
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    base = AlgoConfig(group_size=2)
    assert tokens_in_loss(mask, terminated, rewards, base).sum(1).tolist() == [3, 3, 3, 3]
    filtered = AlgoConfig(group_size=2, filter_zero_std=True)
    assert tokens_in_loss(mask, terminated, rewards, filtered).sum(1).tolist() == [3, 3, 0, 0]
    truncated = AlgoConfig(group_size=2, mask_truncated_completions=True)
    assert tokens_in_loss(mask, terminated, rewards, truncated).sum(1).tolist() == [3, 0, 3, 3]


def test_policy_loss_clips_like_ppo():
    algo = AlgoConfig(eps_low=0.2, eps_high=0.28, loss_type="dapo")
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[0.5, 1.1, 1.5, 1.0]])).requires_grad_()
    adv = torch.tensor([1.0])
    loss, clip = _loss(logp, old, adv, torch.ones(1, 4), algo)
    # positive advantage: ratio capped at 1.28 from above; below, the unclipped term is the max
    want = -(0.5 + 1.1 + 1.28 + 1.0) / 4
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert clip["clip_ratio/high_mean"] == pytest.approx(0.25)
    loss.backward()
    assert logp.grad[0, 2].item() == 0.0  # clipped token gets no gradient
    assert logp.grad[0, 0].item() != 0.0


def test_on_policy_gradient_equals_reinforce_with_advantages():
    """With old = logp.detach(), the gradient is -A * dlogp / N per token (token aggregation)."""
    algo = AlgoConfig(loss_type="dapo")
    logp = torch.randn(2, 3).requires_grad_()
    adv = torch.tensor([0.5, -2.0])
    loss, _ = _loss(logp, logp.detach(), adv, torch.ones(2, 3), algo)
    loss.backward()
    assert torch.allclose(logp.grad, -adv[:, None].expand(2, 3) / 6)


def test_kl_term_only_with_beta():
    logp = torch.zeros(1, 2)
    ref = torch.full((1, 2), -1.0)
    base, _ = _loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), AlgoConfig())
    with_kl, _ = _loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), AlgoConfig(beta=0.5), ref_logp=ref)
    assert base.item() == 0.0
    assert with_kl.item() == pytest.approx(0.5 * (torch.exp(torch.tensor(-1.0)) + 1 - 1).item())


def test_completion_mask_keeps_tokens_through_the_first_eos():
    ids = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5]])
    mask, terminated = completion_mask(ids, eos_id=2)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert terminated.tolist() == [True, False]


@pytest.mark.parametrize("estimator, direction", [("k3", "ref||policy"), ("k3_ratio", "policy||ref")])
def test_kl_estimators_have_the_gradient_their_docs_name(estimator, direction):
    """Exact expectation over every token of a categorical policy (weights pi, detached): the
    penalty's gradient equals the analytic gradient of the KL in the named direction."""
    torch.manual_seed(0)
    theta = torch.randn(7, requires_grad=True)
    ref = torch.log_softmax(torch.randn(7), -1)
    logp_all = torch.log_softmax(theta, -1)
    weight = logp_all.exp().detach()  # E_pi[f] = sum_y pi(y) f(y), the sampling distribution fixed
    algo = AlgoConfig(beta=1.0, kl_estimator=estimator, loss_type="dapo")
    per_token, _ = policy_loss(logp_all.view(1, 7), logp_all.detach().view(1, 7), torch.zeros(1), algo,
                               ref_logp=ref.view(1, 7))
    (grad,) = torch.autograd.grad((weight * per_token.view(7)).sum(), theta)
    p, logp = torch.softmax(theta, -1), torch.log_softmax(theta, -1)
    exact = (p * (logp - ref)).sum() if direction == "policy||ref" else (ref.exp() * (ref - logp)).sum()
    (want,) = torch.autograd.grad(exact, theta)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)
