"""The registry of decoder families (`qerl_exp.config.architectures`) and the one tensor reader of a decoder
(`qerl_exp.decoders.blocks`): what they declare and refuse, every declared architecture through the
padding-free learner against HF's own forward (the independent computation): log-probs, entropies
and gradients in fp32 on the CPU, Qwen3's per-head q/k norms included with scales away from 1 (at
their initial 1 a missing norm would still be caught only by the RMS rescaling), and the step-0
guard that stops a learner computing another model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import (TINY_RUN, metrics_rows, qerl, save_checkpoint, tiny_decoder, tiny_models, tiny_qwen2,
                      with_lora)
from qerl_exp.config import architectures
from qerl_exp.config import QuantConfig
from qerl_exp.config.architectures import ARCHITECTURES, FALLBACK, Architecture, UnsupportedModel
from qerl_exp.decoders import blocks
from qerl_exp.decoders.batch import Sequences
from qerl_exp.decoders.scoring import score_completions, score_packed
from qerl_exp.rl.rollout import HFGenerator, make_generator, sample
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


@pytest.mark.parametrize("family,quant", [(f, "bf16") for f in ARCHITECTURES] + [("qwen3", "nvfp4")])
def test_every_declared_architecture_scores_as_hf_does(family, quant):
    cfg, policy, rollout = _policy(family, quant)
    arch = blocks.read(policy).arch
    assert arch.model_type == family and arch.qk_norm == (family == "qwen3")
    want = score_completions(policy, rollout, 0.7, entropy_grad=True)
    got = score_packed(policy, rollout, 0.7, shared_prefix=True, entropy_grad=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the sampler's own log-probs (HF generate) are the learner's: what sampling/logp_gap measures at step 0
    with torch.no_grad():
        learner = score_packed(policy, rollout, cfg.algo.temperature, shared_prefix=True)[0]
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


def test_an_undeclared_family_is_refused_in_one_line_by_every_reader():
    from transformers import GPT2Config, GPT2LMHeadModel

    from qerl_exp.rl.noise import noisy_norms
    from qerl_exp.quant import quantize_model

    config = GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=32)
    model = GPT2LMHeadModel(config)
    for read in (lambda: architectures.architecture(config), lambda: blocks.read(model),
                 lambda: noisy_norms(model, False), lambda: quantize_model(model, QuantConfig(format="nvfp4"), torch.float32)):
        with pytest.raises(UnsupportedModel) as e:
            read()
        assert "\n" not in str(e.value) and "model type 'gpt2' is not" in str(e.value)
        assert "declare it in qerl_exp/config/architectures.py" in str(e.value)


def _variants():
    """HF configs of declared families with a variant the decoders do not compute, one per spelling."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {
        "use_sliding_window=true": Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0,
                                               num_hidden_layers=2),
        "layer_types with sliding_attention": Qwen3Config(num_hidden_layers=2,
                                                          layer_types=["full_attention", "sliding_attention"]),
        "sliding_window=4096": LlamaConfig(sliding_window=4096),  # Mistral's and Phi-3's spelling
        "attention_chunk_size=8192": LlamaConfig(attention_chunk_size=8192),  # Llama 4's chunked attention
        "hidden_act='gelu'": Qwen2Config(hidden_act="gelu"),
        "mlp_bias=true": LlamaConfig(mlp_bias=True),
        "final_logit_softcapping=30.0": LlamaConfig(final_logit_softcapping=30.0),
    }


@pytest.mark.parametrize("setting", list(_variants()))
def test_a_variant_the_decoders_do_not_compute_is_refused_in_one_line_naming_the_fallback(setting):
    config = _variants()[setting]
    with pytest.raises(UnsupportedModel) as e:
        architectures.architecture(config)
    line = str(e.value)
    assert "\n" not in line and f"{config.model_type} with {setting}" in line and FALLBACK in line
    assert architectures.declared(config).model_type == config.model_type  # AQN and quantization still read it


def test_qwens_sliding_window_setting_is_inert_without_its_flag():
    from transformers import Qwen2Config

    # Qwen2.5 checkpoints ship sliding_window=131072 with use_sliding_window=false: every layer attends fully
    config = Qwen2Config(use_sliding_window=False, sliding_window=131072, max_window_layers=21, num_hidden_layers=2)
    config.sliding_window = 131072  # as an older transformers keeps it
    assert architectures.architecture(config).model_type == "qwen2"


def test_a_family_registered_as_one_line_is_read_and_its_sliding_window_refused(monkeypatch):
    from transformers import MistralConfig, MistralForCausalLM

    # Mistral is the Llama block: one entry makes both decoders compute it...
    monkeypatch.setitem(ARCHITECTURES, "mistral", Architecture("mistral", "MistralConfig"))
    model = with_lora(tiny_decoder("mistral", sliding_window=None))
    assert isinstance(architectures.causal_lm(model), MistralForCausalLM)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    batch = Sequences(ids[:, :3], torch.ones(1, 3, dtype=torch.long), ids[:, 3:], torch.ones(1, 3, dtype=torch.long))
    torch.testing.assert_close(score_packed(model, batch, 1.0, shared_prefix=True)[0],
                               score_completions(model, batch, 1.0)[0], rtol=1e-5, atol=1e-5)
    # ...and its default, a 4096-token sliding window, is refused, not computed as full attention
    with pytest.raises(UnsupportedModel) as e:
        blocks.read(tiny_decoder("mistral", sliding_window=4096))
    line = str(e.value)
    assert "\n" not in line and line.startswith("mistral with sliding_window=4096 (") and FALLBACK in line
    assert MistralConfig().sliding_window == 4096  # what "one line" would otherwise have accepted


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_learner_that_computes_another_model_stops_the_run_before_step_0(tmp_path, monkeypatch, dtype):
    from qerl_exp.train import check_decoders

    # a Qwen3 checkpoint whose next-token distributions are as peaked as a trained model's: at HF's
    # initialisation they are nearly uniform, where no defect moves a log-prob far
    folder = save_checkpoint(tmp_path / "qwen3", "qwen3", head_scale=30)
    cfg, task, models = tiny_models(f"model.name={folder}", f"model.dtype={dtype}", "monitor.every=0",
                                    "algo.group_size=4", "train.prompts_per_step=2", "train.device=cpu")
    cpu, bound = torch.device("cpu"), blocks.DECODER_GAP[getattr(torch, dtype)]
    generator = make_generator("hf", models.sampler.module, models.tokenizer, cpu)
    check_decoders(cfg, task, models, generator, cpu)  # the declared Qwen3: rounding only
    # the padding-free learner reading Qwen3 as if it had no q/k norms (as it once did)
    monkeypatch.setitem(ARCHITECTURES, "qwen3", dataclasses.replace(ARCHITECTURES["qwen3"], qk_norm=False))
    with pytest.raises(blocks.DecoderMismatch) as e:
        check_decoders(cfg, task, models, generator, cpu)
    line = str(e.value)
    assert "\n" not in line and "qwen3 (Qwen3ForCausalLM)" in line and FALLBACK in line
    # measured: 1.56-1.67 nats in either dtype, against DECODER_GAP's 1e-3 (fp32) and 0.25 (bf16)
    assert float(line.split("differ by ")[1].split()[0]) > 4 * bound


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
    assert out.returncode == 2  # refused as a usage error, before the run directory
    line = out.stderr.strip().splitlines()[-1]
    assert "'gpt2' is not one the harness's decoders read" in line and "train.padding_free=false" in line, \
        out.stderr[-2000:]
    assert not (tmp_path / "run").exists()
