"""Each metric definition against a direct computation written out here."""

from __future__ import annotations

import math

import pytest
import torch

from qerl_exp.rl import metrics as M


def _naive_entropy(logits_row):
    z = [math.exp(v) for v in logits_row]
    s = sum(z)
    return -sum((p / s) * math.log(p / s) for p in z)


def test_entropy_from_logits_matches_the_definition():
    logits = torch.randn(3, 4, 7)
    got = M.entropy_from_logits(logits)
    for i in range(3):
        for j in range(4):
            assert got[i, j].item() == pytest.approx(_naive_entropy(logits[i, j].tolist()), rel=1e-5)
    uniform = M.entropy_from_logits(torch.zeros(1, 1, 16))
    assert uniform.item() == pytest.approx(math.log(16), rel=1e-6)


def test_token_mean_ignores_masked_positions():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert M.token_mean(x, mask).item() == pytest.approx(2.0)
    assert M.token_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_k3_kl_is_nonnegative_and_unbiased_for_the_true_kl():
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(5), torch.randn(5)
    p, q = torch.softmax(p_logits, 0), torch.softmax(q_logits, 0)
    samples = torch.multinomial(p, 200_000, replacement=True)
    est = M.kl_k3(p.log()[samples], q.log()[samples])
    assert (est >= 0).all()
    true_kl = (p * (p.log() - q.log())).sum().item()
    assert est.mean().item() == pytest.approx(true_kl, rel=0.05)


def test_full_kl_matches_the_sum_over_the_vocabulary():
    ref, pol = torch.randn(2, 3, 6), torch.randn(2, 3, 6)
    got = M.kl_full(ref, pol)
    p, q = torch.softmax(ref, -1), torch.softmax(pol, -1)
    assert torch.allclose(got, (p * (p / q).log()).sum(-1), atol=1e-6)
    assert torch.allclose(M.kl_full(ref, ref), torch.zeros(2, 3), atol=1e-6)


def test_reward_metrics():
    rewards = {"format": torch.tensor([0.2, 0.2, 0.0, 0.2, 0.2, 0.2]), "correct": torch.tensor([2.0, 0.0, 0.0, 2.0, 2.0, 2.0])}
    got = M.reward_metrics(rewards, {"format": 1.0, "correct": 1.0}, group_size=3)
    totals = [2.2, 0.2, 0.0, 2.2, 2.2, 2.2]
    assert got["reward"] == pytest.approx(sum(totals) / 6)
    import statistics

    assert got["reward_std"] == pytest.approx(statistics.stdev(totals))  # TRL's: the batch std
    assert got["reward_group_std"] == pytest.approx((statistics.stdev(totals[:3]) + statistics.stdev(totals[3:])) / 2)
    assert got["frac_reward_zero_std"] == 0.5
    assert got["rewards/format/mean"] == pytest.approx(1.0 / 6)
    assert got["rewards/correct/mean"] == pytest.approx(8.0 / 6)
    assert got["rewards/format/std"] == pytest.approx(statistics.stdev([0.2, 0.2, 0.0, 0.2, 0.2, 0.2]))


def test_weighted_rewards_leave_out_none_and_unscorable_completions_as_trl_does():
    """TRL's sum: weights on the functions, a None (NaN) left out of its row's sum; a row every
    function left out is unscorable: out of the reward metrics, its group's mean and std, advantage 0.
    Per-function metrics are unweighted, over the rows the function applies to."""
    import statistics

    from qerl_exp.rl.loss import group_advantages

    nan = float("nan")
    fmt = [1.0, 0.0, 1.0, 1.0, nan, 0.0]
    correct = [2.0, nan, 0.0, 3.0, nan, 1.0]
    weights = {"fmt": 0.5, "correct": 2.0}
    rewards = {"fmt": torch.tensor(fmt), "correct": torch.tensor(correct)}
    rows = [[(w, v) for w, v in ((0.5, f), (2.0, c)) if v == v] for f, c in zip(fmt, correct)]
    totals = [sum(w * v for w, v in row) if row else None for row in rows]
    assert totals == [4.5, 0.0, 0.5, 6.5, None, 2.0]
    got = M.reward_metrics(rewards, weights, group_size=3)
    scored = [t for t in totals if t is not None]
    assert got["reward"] == pytest.approx(statistics.mean(scored))
    assert got["reward_std"] == pytest.approx(statistics.stdev(scored))
    assert got["reward_group_std"] == pytest.approx((statistics.stdev(totals[:3]) + statistics.stdev([6.5, 2.0])) / 2)
    assert got["rewards/fmt/mean"] == pytest.approx(statistics.mean([1.0, 0.0, 1.0, 1.0, 0.0]))  # unweighted
    assert got["rewards/fmt/std"] == pytest.approx(statistics.stdev([1.0, 0.0, 1.0, 1.0, 0.0]))
    assert got["rewards/correct/mean"] == pytest.approx(statistics.mean([2.0, 0.0, 3.0, 1.0]))
    assert got["rewards/correct/std"] == pytest.approx(statistics.stdev([2.0, 0.0, 3.0, 1.0]))
    adv = group_advantages(M.total_reward(rewards, weights), 3, scale="group").tolist()
    for group in (slice(0, 3), slice(3, 6)):
        values = [t for t in totals[group] if t is not None]
        mean, std = statistics.mean(values), statistics.stdev(values)
        expected = [0.0 if t is None else (t - mean) / (std + 1e-4) for t in totals[group]]
        assert adv[group] == pytest.approx(expected, rel=1e-5)
    # the names are the table's, so sweeps and figures may read them
    for name in ("rewards/fmt/mean", "rewards/fmt/std"):
        M.check_logged(name)


def test_completion_and_clip_metrics():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    got = M.completion_metrics(mask, torch.tensor([True, False]))
    assert got == {"completions/mean_length": 3.5, "completions/clipped_ratio": 0.5}
    ratio = torch.tensor([[0.5, 1.0, 1.5, 9.0], [0.5, 1.0, 1.5, 1.0]])
    adv = torch.tensor([[-1.0] * 4, [1.0] * 4])
    clip = M.clip_metrics(ratio, adv, mask, eps_low=0.2, eps_high=0.28)
    assert clip["clip_ratio/low_mean"] == pytest.approx(1 / 7)  # row 0, the 0.5 (9.0 is masked)
    assert clip["clip_ratio/high_mean"] == pytest.approx(1 / 7)  # row 1, the 1.5


def test_monitor_metrics_against_direct_computation():
    torch.manual_seed(1)
    B, T, V = 2, 3, 5
    ref_logits, sampler_logits = torch.randn(B, T, V), torch.randn(B, T, V)
    tokens = torch.randint(0, V, (B, T))
    sampler_logp = torch.log_softmax(sampler_logits, -1).gather(-1, tokens[..., None])[..., 0]
    learner_logp = sampler_logp - 0.1
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    sampler_entropy = M.entropy_from_logits(sampler_logits)
    got = {**M.monitor_metrics(sampler_entropy, sampler_logits, ref_logits, mask),
           **M.logp_gap_metric(sampler_logp, learner_logp, mask)}
    keep = mask.bool()
    h = lambda l: -(torch.softmax(l, -1) * torch.log_softmax(l, -1)).sum(-1)  # noqa: E731
    assert got["entropy_gain"] == pytest.approx((h(sampler_logits)[keep].mean() - h(ref_logits)[keep].mean()).item(), rel=1e-5)
    assert got["sampling/logp_gap"] == pytest.approx(0.1, rel=1e-5)
    p = torch.softmax(ref_logits, -1)
    kl = (p * (torch.log_softmax(ref_logits, -1) - torch.log_softmax(sampler_logits, -1))).sum(-1)
    assert got["quant/kl"] == pytest.approx(kl[keep].mean().item(), rel=1e-5)
    assert got["quant/kl"] >= 0


def test_one_final_score_for_the_summary_the_console_and_the_sweep():
    from qerl_exp.sweep.spec import Objective

    rewards = [float(i) for i in range(10)]
    summary = M.run_summary([{"step": i, "reward": r} for i, r in enumerate(rewards)], {})
    assert summary["reward/final"] == pytest.approx((7 + 8 + 9) / 3)  # the last quarter: ceil(2.5) steps
    assert Objective("reward").value(rewards, steps=10) == summary["reward/final"]


def test_eval_metrics_against_direct_counts():
    got = M.eval_metrics([True, False, True, True], [True, True, False, True], [2.2, 0.2, 2.0, 2.2],
                         [True, True, False, True], torch.tensor([-1.0, -3.0]), counts=[2, 0, 4, 1], n=4, k=2,
                         seconds=1.5)
    assert got["eval/pass@1"] == 0.75 and got["eval/format"] == 0.75 and got["eval/clipped_ratio"] == 0.25
    assert got["eval/solution_logp"] == -2.0 and got["eval/problems"] == 4 and got["eval/mean@4"] == 7 / 16
    want = sum(M.pass_at_k(4, c, 2) for c in (2, 0, 4, 1)) / 4
    assert got["eval/pass@2"] == pytest.approx(want)
    # a run without `correct` or `format` functions still grades every problem
    unjudged = M.eval_metrics([], [], [1.0, 0.5, 0.0, 1.0], [True, True, False, True], torch.tensor([-1.0]), counts=[],
                              n=0, k=0, seconds=1.0)
    assert unjudged["eval/problems"] == 4 and math.isnan(unjudged["eval/pass@1"])
