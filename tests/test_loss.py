"""Advantages and the clipped policy-gradient loss against hand computation."""

from __future__ import annotations

import pytest
import torch

from qerl_exp.config import AlgoConfig
from qerl_exp.loss import aggregate, group_advantages, loss_normalizer, policy_loss
from qerl_exp.metrics import clip_metrics
from qerl_exp.rollout import completion_mask


def _loss(logp, old, adv, mask, algo, **kw):
    per_token, ratio = policy_loss(logp, old, adv, algo, **kw)
    loss = aggregate(per_token, mask, algo.loss_agg, loss_normalizer(mask, algo.loss_agg))
    return loss, clip_metrics(ratio, adv.unsqueeze(1).expand_as(ratio), mask, algo.eps_low, algo.eps_high)


def test_group_advantages_normalize_within_each_group():
    r = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    adv = group_advantages(r, group_size=3, scale=True)
    assert adv[:3].tolist() == pytest.approx([-1 / 1.0001, 0.0, 1 / 1.0001], rel=1e-4)
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]
    assert group_advantages(r, 3, scale=False)[:3].tolist() == [-1.0, 0.0, 1.0]


def test_token_and_sequence_aggregation_differ_as_documented():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    token = aggregate(per_token, mask, "token", loss_normalizer(mask, "token"))
    sequence = aggregate(per_token, mask, "sequence", loss_normalizer(mask, "sequence"))
    assert token.item() == pytest.approx(8 / 5)  # DAPO: all tokens equal
    assert sequence.item() == pytest.approx((1 + 4) / 2)  # GRPO: all sequences equal


def test_micro_batch_shares_sum_to_the_batch_loss():
    torch.manual_seed(0)
    per_token, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).long()
    mask[2] = 0  # an empty completion counts in neither normaliser
    for how in ("token", "sequence"):
        whole = aggregate(per_token, mask, how, loss_normalizer(mask, how))
        norm = loss_normalizer(mask, how)
        parts = sum(aggregate(per_token[i : i + 2], mask[i : i + 2], how, norm) for i in range(0, 6, 2))
        assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_policy_loss_clips_like_ppo():
    algo = AlgoConfig(eps_low=0.2, eps_high=0.28, loss_agg="token")
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
    algo = AlgoConfig(loss_agg="token")
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
    algo = AlgoConfig(beta=1.0, kl_estimator=estimator, loss_agg="token")
    per_token, _ = policy_loss(logp_all.view(1, 7), logp_all.detach().view(1, 7), torch.zeros(1), algo,
                               ref_logp=ref.view(1, 7))
    (grad,) = torch.autograd.grad((weight * per_token.view(7)).sum(), theta)
    p, logp = torch.softmax(theta, -1), torch.log_softmax(theta, -1)
    exact = (p * (logp - ref)).sum() if direction == "policy||ref" else (ref.exp() * (ref - logp)).sum()
    (want,) = torch.autograd.grad(exact, theta)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)
