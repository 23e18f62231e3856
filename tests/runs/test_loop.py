"""The RL loop's claims, each read off what a tiny run logs or holds, so that a wrong loop fails:
the learner never sees AQN (`sampling/logp_gap`), relative AQN's logged scale, the clip acts only when a batch is reused, TIS
weights, the entropy bonus, noise on both, the separate sampler re-quantized after each update, the
reference's LoRA kept equal to the policy's, the LR schedule, and resume with quantized bases or a
separate sampler (killed, then rerun into the same directory, as tests/runs/test_reliability.py does).

Runs are in-process (`train.run`) and tiny: 2 prompts x 4 completions of up to 32 tokens, 2-5 steps;
the embedded model's warm-up is cached after its first build.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY_RUN, kill_after, metrics_rows, qerl, run_in_process, stable, tiny_models
from qerl_exp.config import AlgoConfig
from qerl_exp.config.architectures import projections
from qerl_exp.config.compose import compose
from qerl_exp.decoders.scoring import completion_logits, token_logp
from qerl_exp.quant import dense_weight
from qerl_exp.quant.fp4 import quantize_nvfp4
from qerl_exp.rl.learner import update_policy
from qerl_exp.rl.loss import aggregate, loss_normalizer, policy_loss
from qerl_exp.rl.noise import noisy_norms
from qerl_exp.rl.optim import warmup_cosine
from qerl_exp.rl.rollout import HFGenerator, sample
from qerl_exp.tasks import SYSTEM_PROMPT
from qerl_exp import train

LOOP = [*TINY_RUN, "monitor.every=0", "checkpoint.every=0", "tracker.completions_every=0",
        f"model.cache_dir={os.path.expanduser('~/.cache/qerl_exp')}"]
# the default run with a warm-up then a cosine decay, and the monitor on every step
CLEAN = ["train.steps=5", "train.warmup_ratio=0.4", "monitor.every=1"]
# two stages, so that a noisy step exists whether or not stage 0 is noise-free
NOISY = ["quant=nvfp4", "noise=fixed", "noise.sigma=0.01", "noise.num_stages=2", "train.steps=2"]
SAMPLER_NVFP4 = ["rollout.quant=nvfp4", "algo.tis_cap=2", "train.steps=3"]
GAP_ZERO = 1e-5  # sampler and learner one clean policy: KV-cached decode vs full forward, fp32 rounding


def _series(rows: list[dict], name: str) -> list[float]:
    return [r[name] for r in rows]


def _run(run_dir: Path, *overrides: str, on_step=None, keep: dict | None = None) -> list[dict]:
    return run_in_process(run_dir, *LOOP, *overrides, on_step=on_step, keep=keep)


def _lora(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The default run (bf16, no noise), with the reference's and the policy's LoRA recorded after
    every step."""
    keep, seen = {}, []

    def record(step, metrics):
        seen.append((_lora(keep["models"].policy), _lora(keep["models"].reference)))

    rows = _run(tmp_path_factory.mktemp("clean") / "run", *CLEAN, on_step=record, keep=keep)
    return rows, seen


# --------------------------------------------------------------------------- the learner never sees AQN


def test_default_run_has_no_logp_gap_and_no_clipping(clean):
    rows, _ = clean
    assert all(g < GAP_ZERO for g in _series(rows, "sampling/logp_gap")), _series(rows, "sampling/logp_gap")
    # one update per batch: the ratio is exactly 1, the clip counters exactly 0
    assert all(r["clip_ratio/low_mean"] == 0.0 and r["clip_ratio/high_mean"] == 0.0 for r in rows)


@pytest.mark.parametrize("overrides, gap", [
    (NOISY, True),  # AQN on the sampler only (the paper): sampler and learner disagree
    ([*NOISY, "noise.apply_to=both"], False),  # the learner under the same draw: the gap closes
    (["quant=nvfp4", "train.steps=2"], False),  # quantization alone: the sampler is the learner
])
def test_logp_gap_shows_whether_the_learner_sees_the_sampling_noise(tmp_path, overrides, gap):
    rows = _run(tmp_path / "run", *overrides)
    noisy = [r["noise/sigma"] > 0 for r in rows]
    gaps = _series(rows, "sampling/logp_gap")
    assert any(noisy) or "noise=fixed" not in overrides
    for g, n in zip(gaps, noisy):
        if gap and n:
            assert g > 1e-4, gaps  # measured 1e-3..3e-3 at sigma 0.01
        else:
            assert g < GAP_ZERO, gaps


def test_relative_noise_is_logged_in_units_of_each_norm_scale(tmp_path):
    keep = {}
    rows = _run(tmp_path / "run", *NOISY, "noise.relative=true", keep=keep)
    medians = sorted(torch.quantile(m.weight.detach().float().abs(), 0.5).item()
                     for _, m in noisy_norms(keep["models"].sampler.module, include_final_norm=False))
    for r in rows:
        sigma = r["noise/sigma"]
        assert sigma == 0.01
        assert r["noise/sigma_eff_min"] == pytest.approx(sigma * medians[0], rel=1e-6)
        assert r["noise/sigma_eff_max"] == pytest.approx(sigma * medians[-1], rel=1e-6)
        assert r["noise/sigma_eff_median"] == pytest.approx(sigma * float(np.median(medians)), rel=1e-6)


# --------------------------------------------------------------------------- clipping needs a reused batch


def test_dapo_with_several_iterations_clips(tmp_path):
    rows = _run(tmp_path / "run", "algo=dapo", "algo.num_iterations=4", "train.steps=3")
    clipped = [r["clip_ratio/low_mean"] + r["clip_ratio/high_mean"] for r in rows]
    assert sum(clipped) > 0, clipped


# --------------------------------------------------------------------------- TIS


def test_tis_weights_are_the_capped_old_over_sampler_ratio():
    torch.manual_seed(0)
    b, t, cap = 3, 5, 2.0
    old = -torch.rand(b, t, dtype=torch.float64) * 3
    sampler = old + torch.randn(b, t, dtype=torch.float64)  # some tokens above the cap, some below 1
    adv = torch.tensor([1.5, -0.5, 2.0], dtype=torch.float64)
    logp = old.clone().requires_grad_()  # the first update: ratio 1, so the loss is -A * weight
    algo = AlgoConfig(tis_cap=cap)
    per_token, _ = policy_loss(logp, old, adv, algo, sampler_logp=sampler)
    want = [[min(math.exp(old[i, j].item() - sampler[i, j].item()), cap) for j in range(t)] for i in range(b)]
    want = torch.tensor(want, dtype=torch.float64)
    assert (want == cap).any() and (want < 1).any()
    torch.testing.assert_close(per_token, -adv[:, None] * want, rtol=1e-12, atol=0)
    per_token.sum().backward()
    torch.testing.assert_close(logp.grad, -adv[:, None] * want, rtol=1e-12, atol=0)  # d ratio / d logp = ratio = 1
    untruncated, _ = policy_loss(logp, old, adv, AlgoConfig(), sampler_logp=sampler)
    torch.testing.assert_close(untruncated, (-adv[:, None]).expand(b, t), rtol=0, atol=0)  # tis_cap=0: no weights


def test_the_learner_weights_each_token_by_its_tis_weight(tiny_policy):
    cfg, task, models = tiny_policy
    policy, tok = models.policy, models.tokenizer
    prompts = [tok.render_prompt(p.question, SYSTEM_PROMPT) for p in task.eval_problems()[:2]]
    algo = AlgoConfig(group_size=3, max_new_tokens=8, loss_type="dapo", tis_cap=2.0)
    torch.manual_seed(0)
    rollout = sample(HFGenerator(policy, tok), tok, prompts, algo, torch.device("cpu"))
    mask = rollout.completion_mask
    with torch.no_grad():  # the learner's log-probs by another path: full logits
        learner_logp = token_logp(completion_logits(policy, rollout, algo.temperature), rollout.completion_ids)
    shift = torch.linspace(-1.5, 1.5, mask.numel()).view_as(mask)  # old - sampler, per token
    rollout.sampler_logp = learner_logp - shift
    advantages = torch.tensor([1.0, -0.5, 0.25, 2.0, -1.0, 0.5])
    params = [p for p in policy.parameters() if p.requires_grad]
    update = update_policy(policy, torch.optim.SGD(params, lr=0.0), params, rollout, advantages, mask, algo,
                           cfg.train)
    weights = shift.exp().clamp(max=2.0)
    want = (-advantages[:, None] * weights * mask).sum() / mask.sum()
    assert update.loss == pytest.approx(want.item(), rel=1e-4)


def test_separate_nvfp4_sampler_with_tis_runs_requantized_after_every_update(tmp_path):
    keep, checked, layers = {}, [], set()

    def check(step, metrics):
        # the sampler holds quantize(base + B A * alpha / r) of the policy as it stands after the update
        policy, sampler = keep["models"].policy, keep["models"].sampler.module
        changed = 0
        for path, ((_, _, lora), (_, _, module)) in enumerate(zip(projections(policy, cfg.quant.targets),
                                                                  projections(sampler, cfg.quant.targets))):
            layers.add(id(module))  # re-quantized in place, so a rollout engine keeps reading it
            base = lora.base_layer.weight.detach().float()
            delta = lora.lora_B["default"].weight @ lora.lora_A["default"].weight * (cfg.lora.alpha / cfg.lora.r)
            want = quantize_nvfp4(base + delta.detach()).dequantize()
            assert torch.equal(dense_weight(module), want), (step, path)
            changed += int((want != quantize_nvfp4(base).dequantize()).sum())
        checked.append(changed)

    cfg = compose([*LOOP, *SAMPLER_NVFP4])[0]
    rows = _run(tmp_path / "run", *SAMPLER_NVFP4, on_step=check, keep=keep)
    assert len(checked) == 3 and checked[-1] > 0, checked  # the LoRA moved the quantized weights
    assert len(layers) == len(projections(keep["models"].sampler.module, cfg.quant.targets))
    assert all(math.isfinite(r["loss"]) and r["train/skipped"] == 0 for r in rows)
    assert all(g > 1e-4 for g in _series(rows, "sampling/logp_gap"))  # an NVFP4 sampler, a bf16 learner


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_requantizing_the_sampler_draws_no_random_numbers(fmt):
    # a resumed run restores torch's RNG and then re-quantizes the sampler: a draw there would make
    # its rollouts differ from the uninterrupted run's
    _, _, models = tiny_models(*LOOP, f"rollout.quant={fmt}")
    before = torch.get_rng_state()
    models.sampler.sync()
    assert torch.equal(torch.get_rng_state(), before)


# --------------------------------------------------------------------------- sampling controls


@pytest.mark.parametrize("stop", ["</answer>", "</think>"])
def test_no_logged_completion_continues_past_its_stop_string(tmp_path, stop):
    """The run of `algo.top_k=5 algo.min_p=0.05 'algo.stop=["</answer>"]'`: every completion the
    tracker logs ends at the first stop string, which it keeps; `</think>` stops the embedded
    model mid-answer, so the stop is seen to act."""
    rows = _run(tmp_path / "run", "algo.top_k=5", "algo.min_p=0.05", f"algo.stop=['{stop}']", "train.steps=3",
                "tracker.completions_every=1")
    logged = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    texts = [r["completion"] for r in logged]
    assert len(rows) == 3 and len(texts) == 3 * 2 * 4  # every completion of every step
    assert all(stop not in t or t.index(stop) == len(t) - len(stop) for t in texts), texts
    assert sum(t.endswith(stop) for t in texts) >= len(texts) // 2, texts
    if stop == "</think>":
        assert not any("<answer>" in t for t in texts)
        assert all(r["completions/clipped_ratio"] == 0 for r in rows)  # a stop string ends, not truncates


# --------------------------------------------------------------------------- the entropy bonus


def test_entropy_bonus_adds_minus_coef_times_the_entropy_gradient():
    torch.manual_seed(0)
    b, t, v, coef = 2, 3, 7, 0.3
    logits = torch.randn(b, t, v, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, v, (b, t))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([0.7, -1.2], dtype=torch.float64)

    def grad(algo):
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # as the learner scores it, in float64
        per_token, _ = policy_loss(logp, logp.detach(), adv, algo, entropy=entropy)
        loss = aggregate(per_token, mask, algo.loss_type, loss_normalizer(mask, algo))
        return torch.autograd.grad(loss, logits)[0]

    p = torch.softmax(logits.detach(), dim=-1)
    h = -(p * p.log()).sum(-1, keepdim=True)
    d_entropy = -p * (p.log() + h)  # dH/dz of a softmax, by hand
    want = -coef * d_entropy * mask[..., None] / mask.sum()
    got = grad(AlgoConfig(loss_type="dapo", entropy_coef=coef)) - grad(AlgoConfig(loss_type="dapo"))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_entropy_bonus_changes_the_entropy_trajectory(clean, tmp_path):
    rows, _ = clean
    bonus = _run(tmp_path / "run", *CLEAN, "algo.entropy_coef=1.0")
    base, more = _series(rows, "entropy"), _series(bonus, "entropy")
    assert more[0] == base[0]  # logged before the first update: the same policy and rollout
    assert all(abs(a - b) > 1e-4 for a, b in zip(base[1:], more[1:])), (base, more)


# --------------------------------------------------------------------------- reference, LR schedule


def test_reference_lora_is_the_policys_of_the_step(clean):
    rows, seen = clean
    for step in range(1, len(seen)):
        policy_before, _ = seen[step - 1]  # the policy that sampled step `step`
        _, reference = seen[step]
        assert all(torch.equal(reference[n], policy_before[n]) for n in reference), step
    first, last = seen[0][0], seen[-1][0]
    assert any(not torch.equal(first[n], last[n]) for n in first)  # the LoRA did move
    # bf16 reference and policy with equal LoRA, no noise: the monitor sees no difference
    assert all(abs(r["quant/kl"]) < 1e-6 and abs(r["entropy_gain"]) < 1e-5 for r in rows)


def test_lr_warms_up_then_follows_a_cosine(clean):
    rows, _ = clean
    peak, steps, warmup = 2e-3, 5, 2  # conf/config.yaml's lr; 0.4 of 5 steps
    want = [peak * (k + 1) / warmup if k < warmup else peak * 0.5 * (1 + math.cos(math.pi * (k - warmup) / (steps - warmup)))
            for k in range(steps)]
    assert _series(rows, "lr") == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx([1e-3, 2e-3, 2e-3, 1.5e-3, 0.5e-3])
    f = warmup_cosine(10, 0.0)  # no warm-up: the cosine starts at the peak
    assert [f(0), f(5)] == pytest.approx([1.0, 0.5])


# --------------------------------------------------------------------------- resume


RESUME = [*TINY_RUN, "train.steps=5", "checkpoint.every=1", "monitor.every=2"]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["quant=nvfp4", "noise=fixed"],
    ["quant=nf4"],
    ["rollout.quant=nvfp4", "algo.tis_cap=2"],
], ids=["nvfp4_aqn", "nf4", "nvfp4_sampler"])
def test_killed_run_resumes_to_the_uninterrupted_metrics(tmp_path, overrides):
    args = [*RESUME, *overrides]
    out = qerl(*args, f"run_dir={tmp_path / 'whole'}")
    assert out.returncode == 0, out.stderr[-2000:]
    run_dir = tmp_path / "killed"
    kill_after(args, run_dir, 2)
    out = qerl(*args, f"run_dir={run_dir}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resuming" in out.stderr
    rows = metrics_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(5)), "duplicate or missing steps after resume"
    assert stable(rows) == stable(metrics_rows(tmp_path / "whole"))
