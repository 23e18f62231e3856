"""The one reader of a decoder (`qerl_exp.blocks`): what it declares and refuses, and every declared
architecture through the padding-free learner against HF's own forward (the independent
computation): log-probs, entropies and gradients in fp32 on the CPU, Qwen3's per-head q/k norms
included with scales away from 1 (at their initial 1 a missing norm would still be caught only by
the RMS rescaling)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import TINY_RUN, metrics_rows, qerl, save_checkpoint, tiny_models, tiny_qwen2, with_lora
from qerl_exp import blocks, padding_free
from qerl_exp.loss import score_completions
from qerl_exp.rollout import HFGenerator, sample
from qerl_exp.tasks import SYSTEM_PROMPT


def _policy(family: str, quant: str = "bf16"):
    """A random embedded-shaped policy of `family` with a non-trivial adapter and norm scales, and a
    rollout sampled from it."""
    cfg, task, models = tiny_models(
        "model.warmup.max_steps=0", "monitor.every=0", f"quant={quant}", f"model.family={family}", "lora.r=8",
        "algo.group_size=3", "train.prompts_per_step=2", "algo.max_new_tokens=10", "train.device=cpu")
    policy, tok = models.policy, models.tokenizer
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            elif "norm" in n:  # every norm scale, q/k norms included, away from 1
                p.copy_(torch.rand(p.shape, generator=gen) * 1.5 + 0.25)
    prompts = [tok.render_prompt(p.question, SYSTEM_PROMPT) for p in task.sample(2, np.random.default_rng(0))]
    torch.manual_seed(0)
    return cfg, policy, sample(HFGenerator(policy, tok), tok, prompts, cfg.algo, torch.device("cpu"))


def _grads(policy, logp, entropy):
    params = [p for p in policy.parameters() if p.requires_grad]
    return torch.autograd.grad(logp.sum() + 0.5 * entropy.sum(), params)


@pytest.mark.parametrize("family,quant", [("qwen3", "bf16"), ("qwen3", "nvfp4"), ("llama", "bf16"), ("qwen2", "bf16")])
def test_every_declared_architecture_scores_as_hf_does(family, quant):
    cfg, policy, rollout = _policy(family, quant)
    arch = blocks.read(policy).arch
    assert arch.model_type == family and arch.qk_norm == (family == "qwen3")
    want = score_completions(policy, rollout, 0.7, entropy_grad=True)
    got = padding_free.score(policy, rollout, 0.7, shared_prefix=True, entropy_grad=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the sampler's own log-probs (HF generate) are the learner's: what sampling/logp_gap measures at step 0
    with torch.no_grad():
        learner = padding_free.score(policy, rollout, cfg.algo.temperature, shared_prefix=True)[0]
    assert (rollout.sampler_logp - learner).abs()[rollout.completion_mask.bool()].max() < 1e-4
    for a, b in zip(_grads(policy, *got), _grads(policy, *want)):
        err, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert err <= 1e-5 * scale, f"max error {err:.3g} against a scale of {scale:.3g}"


def test_qwen3_reads_its_per_head_norms_and_a_wide_head():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # Qwen3's head_dim is its own setting: heads * head_dim (4 x 48) need not equal the width (128)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=48))
    blk = blocks.read(model).blocks[0]
    assert (blk.heads, blk.kv_heads, blk.head_dim) == (4, 2, 48)
    assert blk.q_norm is model.model.layers[0].self_attn.q_norm.weight and blk.k_norm.shape == (48,)
    assert blk.qkv.out_features == [192, 96, 96] and blk.qkv.adapters is None


def test_a_model_no_decoder_reads_is_refused_in_one_line_naming_the_fallback():
    from transformers import GPT2Config, Qwen2Config

    with pytest.raises(blocks.UnsupportedModel) as e:
        blocks.architecture(GPT2Config())
    assert "\n" not in str(e.value) and "'gpt2'" in str(e.value) and blocks.FALLBACK in str(e.value)
    with pytest.raises(blocks.UnsupportedModel, match="sliding-window"):
        blocks.architecture(Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0,
                                        num_hidden_layers=2))
    with pytest.raises(blocks.UnsupportedModel, match="hidden_act='gelu'"):
        blocks.architecture(Qwen2Config(hidden_act="gelu"))


def test_a_projection_without_an_adapter_in_an_adapted_group_reads_as_rank_zero():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_qwen2(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    blk = blocks.read(model).blocks[0]
    attn = model.get_base_model().model.layers[0].self_attn
    q, k, v = blk.qkv.adapters
    assert q.a is attn.q_proj.lora_A["default"].weight and v.b is attn.v_proj.lora_B["default"].weight
    assert (k.a.shape, k.b.shape, k.scale) == ((0, 128), (64, 0), 0.0)  # k_proj: none, as a zero-rank one
    assert blk.qkv.bases[1] is attn.k_proj and blk.gate_up.adapters is None  # no adapter in the MLP at all
    assert blocks.read(model, adapters=False).blocks[0].qkv.adapters is None  # the reference reads no adapter


def test_a_group_views_its_stacked_dense_weights_instead_of_copying_them():
    model = with_lora(tiny_qwen2())
    group = blocks.read(model).blocks[0].qkv
    built = group.base_weight(torch.float32)
    stacked = blocks.stack_dense(group)
    torch.testing.assert_close(stacked, built, rtol=0, atol=0)
    viewed = blocks.read(model).blocks[0].qkv.base_weight(torch.float32)
    assert viewed.data_ptr() == stacked.data_ptr() and torch.equal(viewed, built)
    assert blocks.stack_dense(group).data_ptr() == stacked.data_ptr()  # stacked once


def test_a_learner_that_computes_another_model_stops_the_run_before_step_0(monkeypatch):
    from qerl_exp.rollout import make_generator
    from qerl_exp.train import DECODER_GAP, DecoderMismatch, check_decoders

    cfg, task, models = tiny_models("model.warmup.max_steps=0", "monitor.every=0", "model.family=qwen3",
                                    "algo.group_size=2", "train.prompts_per_step=2", "train.device=cpu")
    cpu = torch.device("cpu")
    generator = make_generator("hf", models.sampler.module, models.tokenizer, cpu)
    check_decoders(cfg, task, models, generator, cpu)  # the declared Qwen3: rounding only
    # the padding-free learner reading Qwen3 as if it had no q/k norms (as it once did)
    monkeypatch.setitem(blocks.ARCHITECTURES, "qwen3", blocks.Architecture("qwen3", qk_norm=False))
    with pytest.raises(DecoderMismatch) as e:
        check_decoders(cfg, task, models, generator, cpu)
    line = str(e.value)
    assert "\n" not in line and "qwen3 (Qwen3ForCausalLM)" in line and blocks.FALLBACK in line
    assert float(line.split("differ by ")[1].split()[0]) > 10 * DECODER_GAP[torch.float32]


@pytest.mark.slow
@pytest.mark.parametrize("padding_free", ["true", "false"])
def test_a_qwen3_checkpoint_trains_through_decoders_that_match_it(tmp_path, padding_free):
    folder = save_checkpoint(tmp_path / "qwen3", "qwen3")
    run = tmp_path / "run"
    out = qerl(f"model.name={folder}", "train.steps=3", f"train.padding_free={padding_free}", "algo.max_new_tokens=8",
               "monitor.every=0", f"run_dir={run}", *TINY_RUN)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = metrics_rows(run)
    assert rows[0]["sampling/logp_gap"] < 1e-4  # the learner's log-probs are HF generate's, to float32 rounding


@pytest.mark.slow
def test_a_checkpoint_of_an_undeclared_architecture_is_refused_in_one_line(tmp_path):
    folder = save_checkpoint(tmp_path / "gpt2", "gpt2")
    out = qerl(f"model.name={folder}", "train.steps=1", f"run_dir={tmp_path / 'run'}", *TINY_RUN)
    assert out.returncode == 1
    line = out.stderr.strip().splitlines()[-1]
    assert "'gpt2'" in line and blocks.FALLBACK in line, out.stderr[-2000:]
