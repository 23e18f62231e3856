"""The learner at scale and its update rule, against independent computations:
frozen 4-bit layers keep no dense weight for backward, chunked scoring equals the full logits,
micro-batches give the whole batch's gradient, old log-probs make the ratio 1 only in the first
update, and the base is built one block at a time."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn

from conftest import tiny_models, tiny_qwen2, with_lora
from qerl_exp.config import LOSS_TYPES, AlgoConfig, TrainConfig
from qerl_exp.config import ModelConfig, QuantConfig
from qerl_exp.decoders.batch import Rollout
from qerl_exp.decoders.scoring import completion_logits, score_completions, token_logp
from qerl_exp.models.synthetic import build
from qerl_exp.quant import quantize_model
from qerl_exp.quant.fp4 import FP4Linear
from qerl_exp.rl.learner import rows, update_policy
from qerl_exp.rl.metrics import entropy_from_logits
from qerl_exp.rl.rollout import HFGenerator, sample
from qerl_exp.tasks import SYSTEM_PROMPT
from test_loss import trl_loss


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_frozen_fp4_linear_saves_no_dense_weight_and_its_input_grad_is_exact(fmt):
    torch.manual_seed(0)
    dense = nn.Linear(256, 128, bias=True)
    layer = FP4Linear.from_linear(dense, fmt)
    x = torch.randn(3, 5, 256, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    dense_bytes = 128 * 256 * 4
    assert sum(saved) <= 0.3 * dense_bytes, saved
    g = torch.randn_like(y)
    y.backward(g)
    w = layer.dequantize(torch.float64)  # independent check: fp64 dequantize + matmul
    want_y = x.detach().double() @ w.T + layer.bias.double()
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), g.double() @ w, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def setup():
    cfg, task, models = tiny_models(
        "model.warmup.max_steps=0", "monitor.every=0", "quant=nvfp4", "lora.r=8", "algo.group_size=4",
        "train.prompts_per_step=2", "algo.max_new_tokens=12", "train.device=cpu",
    )
    policy, tok = models.policy, models.tokenizer
    with torch.no_grad():  # LoRA B is zero at init: give the adapter a non-trivial state
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    problems = task.sample(2, np.random.default_rng(0))
    prompts = [tok.render_prompt(p.question, SYSTEM_PROMPT) for p in problems]
    torch.manual_seed(0)
    rollout = sample(HFGenerator(policy, tok), tok, prompts, cfg.algo, torch.device("cpu"))
    return cfg, policy, rollout


def test_chunked_scores_equal_the_full_logits_in_values_and_gradients(setup):
    cfg, policy, rollout = setup
    params = [p for p in policy.parameters() if p.requires_grad]
    logits = completion_logits(policy, rollout, 0.7)
    mask = rollout.completion_mask.float()
    want_logp, want_ent = token_logp(logits, rollout.completion_ids) * mask, entropy_from_logits(logits) * mask
    want_grads = torch.autograd.grad((want_logp.sum() + want_ent.sum()), params)
    logp, ent = score_completions(policy, rollout, 0.7, entropy_grad=True, chunk=3 * 40)  # a few tokens per chunk
    grads = torch.autograd.grad((logp.sum() + ent.sum()), params)
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_metric_entropy_keeps_nothing_for_backward(setup):
    # On the GPU an entropy with grad that the loss ignores held two [chunk, V] fp32 tensors per
    # chunk until backward ended (2.4 GiB at 7B, 2048 tokens): by default it has no grad at all.
    cfg, policy, rollout = setup
    params = [p for p in policy.parameters() if p.requires_grad]
    logits = completion_logits(policy, rollout, 0.7)
    want_logp = token_logp(logits, rollout.completion_ids) * rollout.completion_mask.float()
    want_grads = torch.autograd.grad(want_logp.sum(), params)
    logp, ent = score_completions(policy, rollout, 0.7, chunk=3 * 40)
    assert logp.requires_grad and not ent.requires_grad
    torch.testing.assert_close(ent, entropy_from_logits(logits).detach() * rollout.completion_mask.float(),
                               rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(logp.sum(), params), want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _sgd_delta(policy, rollout, cfg, **changes):
    """Parameter change of one update under SGD(lr=1): minus the accumulated gradient."""
    algo = dataclasses.replace(cfg.algo, **changes.pop("algo", {}))
    train = dataclasses.replace(cfg.train, **changes)
    params = [p for p in policy.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    advantages = torch.linspace(-1, 1, rollout.completion_ids.shape[0])
    result = update_policy(policy, torch.optim.SGD(params, lr=1.0), params, rollout, advantages,
                           rollout.completion_mask, algo, train)
    delta = [p.detach() - b for p, b in zip(params, before)]
    with torch.no_grad():
        for p, b in zip(params, before):
            p.copy_(b)
    return result, delta


@pytest.mark.parametrize("agg", ["grpo", "dapo"])
@pytest.mark.parametrize("padding_free", [False, True])
def test_micro_batches_give_the_whole_batch_loss_and_gradient(setup, agg, padding_free):
    cfg, policy, rollout = setup
    size = {"micro_batch_tokens": 60} if padding_free else {"micro_batch_size": 3}
    whole, d_whole = _sgd_delta(policy, rollout, cfg, padding_free=padding_free, micro_batch_size=0,
                                micro_batch_tokens=0, grad_clip=0.0, algo={"loss_type": agg})
    micro, d_micro = _sgd_delta(policy, rollout, cfg, padding_free=padding_free, **size, grad_clip=0.0,
                                algo={"loss_type": agg})
    assert micro.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-7)
    assert any(d.abs().max() > 0 for d in d_whole)
    for a, b in zip(d_micro, d_whole):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("padding_free", [False, True])
def test_each_loss_type_through_the_learner_equals_its_formula(setup, padding_free, loss_type, level):
    """Two updates on one batch, micro-batched (the second off-policy: its ratio is not 1 and clips):
    the parameters move as two SGD steps on TRL's formula (`test_loss.trl_loss`) over one HF forward
    of the whole batch, and the logged loss is the mean of the two."""
    cfg, policy, rollout = setup
    algo = dataclasses.replace(cfg.algo, loss_type=loss_type, importance_sampling_level=level, num_iterations=2,
                               eps_low=0.2, eps_high=0.28)
    size = {"micro_batch_tokens": 60} if padding_free else {"micro_batch_size": 3}
    train = dataclasses.replace(cfg.train, padding_free=padding_free, grad_clip=0.0, **size)
    loss_mask = rollout.completion_mask.clone()
    loss_mask[1] = 0  # a completion out of the loss (a dropped group's, a masked truncated one)
    advantages = torch.linspace(-1, 1, rollout.completion_ids.shape[0])
    params = [p for p in policy.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    lr = 2.0
    update = update_policy(policy, torch.optim.SGD(params, lr=lr), params, rollout, advantages, loss_mask, algo, train)
    got = [p.detach() - b for p, b in zip(params, before)]
    with torch.no_grad():
        for p, b in zip(params, before):
            p.copy_(b)
        old = score_completions(policy, rollout, algo.temperature)[0]
    losses = []
    for _ in range(2):
        logp, _ = score_completions(policy, rollout, algo.temperature)
        loss = trl_loss(logp, old, advantages, loss_mask, algo)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(lr * g)
        losses.append(loss.item())
    want = [p.detach() - b for p, b in zip(params, before)]
    with torch.no_grad():
        for p, b in zip(params, before):
            p.copy_(b)
    assert update.clip["clip_ratio/low_mean"] + update.clip["clip_ratio/high_mean"] > 0
    assert update.loss == pytest.approx(sum(losses) / 2, rel=1e-4, abs=1e-7)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_ratio_is_one_in_the_first_update_only(setup):
    cfg, policy, rollout = setup
    one, _ = _sgd_delta(policy, rollout, cfg, algo={"num_iterations": 1})
    assert one.ratio_dev == [0.0] and one.clip == {"clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0}
    several, _ = _sgd_delta(policy, rollout, cfg, algo={"num_iterations": 2, "mini_batches": 2, "eps_low": 0.0, "eps_high": 0.0})
    assert several.steps == 4 and several.ratio_dev[0] < 1e-6
    assert all(d > 1e-4 for d in several.ratio_dev[1:])  # the batch is reused after an update
    assert several.clip["clip_ratio/low_mean"] + several.clip["clip_ratio/high_mean"] > 0
    # the old policy's log-probs are the learner's before any update, on every row
    torch.testing.assert_close(several.logp, one.logp, rtol=1e-5, atol=1e-6)


def test_rows_drop_only_padding_no_row_uses():
    pm = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    cm = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    ids = torch.arange(12).view(3, 4)
    r = Rollout(ids, pm, ids[:, :3], cm, cm.float(), cm.float(), torch.ones(3, dtype=torch.bool), ["a", "b", "c"])
    sub = rows(r, torch.tensor([0, 1]))
    assert sub.prompt_ids.tolist() == [[1, 2, 3], [5, 6, 7]] and sub.completion_mask.tolist() == [[1, 1], [1, 0]]
    assert sub.texts == ["a", "b"]


def test_blockwise_build_quantizes_each_block_before_the_next_exists():
    cfg = ModelConfig(hidden_size=128, intermediate_size=256, num_layers=3, vocab_size=320, tie_embeddings=False)
    seen = []

    def record(block):
        seen.append(block)
        # every block seen before is already quantized; this one is dense and real
        assert all(isinstance(b.mlp.down_proj, FP4Linear) for b in seen[:-1])
        assert type(block.mlp.down_proj) is nn.Linear and block.mlp.down_proj.weight.device.type == "cpu"
        quantize_model(block, QuantConfig(format="nvfp4"), torch.float32)

    model = build(cfg, 40, "cpu", torch.float32, on_block=record)
    assert len(seen) == 3 and all(isinstance(b.self_attn.q_proj, FP4Linear) for b in model.model.layers)
    assert model.lm_head.weight.shape == (320, 128) and model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.isfinite(model(input_ids=torch.randint(0, 320, (2, 6))).logits).all()


def test_monitor_in_parts_equals_the_whole_batch(setup):
    """The noise monitor scored `micro` completions at a time gives the whole batch's token means."""
    from qerl_exp.rl.noise import AQN
    from qerl_exp.train import _monitor

    cfg, policy, rollout = setup
    noise = dataclasses.replace(cfg.noise, schedule="fixed", sigma=0.05)
    _, _, models = tiny_models("model.warmup.max_steps=0", "quant=nvfp4", "lora.r=8", "train.device=cpu")
    reference, sampler = models.reference, models.sampler.module
    aqn = AQN(sampler, noise, seed=3)
    aqn.draw(0.05)
    whole = _monitor(policy, sampler, reference, aqn, rollout, 1.0, 0)
    parts = _monitor(policy, sampler, reference, aqn, rollout, 1.0, 3)
    assert set(whole) == {"entropy_gain", "quant/kl"} and whole["quant/kl"] > 0
    assert parts["quant/kl"] == pytest.approx(whole["quant/kl"], rel=1e-5)
    # entropy_gain is a difference of two fp32 token means of ~5.8 nats (vocab 320), whose ulp is
    # 4.8e-7: summed in parts they move by an ulp on some CPUs (AMD EPYC), bit-equal on others
    # (weighting the parts by rows instead of tokens moves the KL by ~2 %)
    assert parts["entropy_gain"] == pytest.approx(whole["entropy_gain"], abs=4 * 4.8e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_learner_gradient_is_finite_where_cudnn_attention_backward_is_not():
    """pytorch#196678 (torch 2.11, H100/H200): cuDNN's SDPA backward gives NaN dQ for lengths 64 mod 128
    when a query row is fully masked, as a left-padded prompt's padding rows are. The learner's update
    on such a batch (64 prompt + 128 completion tokens, head dim 64) takes a finite step."""
    policy = with_lora(tiny_qwen2(hidden=128, heads=2, kv=2, max_positions=256)).cuda().to(torch.bfloat16)
    b, p, t = 8, 64, 128
    g = torch.Generator().manual_seed(0)
    prompt_mask = (torch.arange(p)[None, :] >= 4 * torch.arange(b)[:, None]).long()  # row i: 4 i pads on the left
    ids = torch.randint(0, 96, (b, p + t), generator=g)
    rollout = Rollout(ids[:, :p].cuda(), prompt_mask.cuda(), ids[:, p:].cuda(), torch.ones(b, t, dtype=torch.long).cuda(),
                      torch.zeros(b, t).cuda(), torch.zeros(b, t).cuda(), torch.zeros(b, dtype=torch.bool).cuda(),
                      [""] * b)
    params = [q for q in policy.parameters() if q.requires_grad]
    update = update_policy(policy, torch.optim.SGD(params, lr=0.0), params, rollout, torch.linspace(-1, 1, b).cuda(),
                           rollout.completion_mask, AlgoConfig(), TrainConfig(padding_free=False, micro_batch_size=0))
    assert update.skipped == 0 and math.isfinite(update.grad_norm) and update.grad_norm > 0
