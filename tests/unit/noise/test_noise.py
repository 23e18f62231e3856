"""AQN: the schedules against the paper's formula, and where the noise goes (and does not)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_qwen2
from qerl_exp.config import NoiseConfig
from qerl_exp.config.architectures import ARCHITECTURES, Architecture
from qerl_exp.rl.noise import AQN, SCALE_WARNING, Schedule, noisy_norms, sigma_at, stage_of


def test_exp_schedule_matches_paper_eq8():
    cfg = NoiseConfig(schedule="exp", sigma_start=1e-2, sigma_end=1e-4, num_stages=10)
    got = [sigma_at(cfg, step, 20)[0] for step in range(20)]
    want = [0.0, 0.0] + [1e-2 * (1e-2) ** ((k - 1) / 9) for k in range(1, 10) for _ in range(2)]
    assert got == pytest.approx(want, rel=1e-12)


def test_code_denominator_reaches_sigma_end():
    cfg = NoiseConfig(schedule="exp", sigma_start=5e-2, sigma_end=5e-4, num_stages=10, denominator="code")
    assert sigma_at(cfg, 99, 100)[0] == pytest.approx(5e-4)
    paper = NoiseConfig(schedule="exp", sigma_start=5e-2, sigma_end=5e-4, num_stages=10)
    assert sigma_at(paper, 99, 100)[0] > 5e-4


@pytest.mark.parametrize("kind", ["exp", "linear", "cosine", "log"])
def test_decays_start_at_sigma_start_and_fall_monotonically(kind):
    cfg = NoiseConfig(schedule=kind, sigma_start=1e-2, sigma_end=1e-4, num_stages=5, denominator="code")
    sigmas = [sigma_at(cfg, s, 50)[0] for s in range(50)]
    assert sigmas[0] == 0.0 and sigmas[10] == pytest.approx(1e-2)
    assert sigmas[-1] == pytest.approx(1e-4)
    decaying = sigmas[10:]
    assert all(a >= b for a, b in zip(decaying, decaying[1:]))


def test_stages_split_steps_evenly():
    assert [stage_of(s, 20, 10) for s in range(20)] == [k for k in range(10) for _ in range(2)]
    assert stage_of(6, 7, 10) == 8  # fewer steps than stages: stages are skipped, never exceeded


def test_adaptive_controller_moves_toward_target_and_stays_bounded():
    cfg = NoiseConfig(schedule="adaptive", sigma=1e-2, target_value=0.5, target_relative=False, gain=0.5,
                      sigma_min=1e-4, sigma_max=2e-2)
    sched = Schedule(cfg, 10)
    sched.observe({"sampler/entropy": 0.1})  # too little entropy: more noise
    assert sched(1)[0] > 1e-2
    for _ in range(20):
        sched.observe({"sampler/entropy": 0.0})
    assert sched(1)[0] == pytest.approx(2e-2)
    for _ in range(50):
        sched.observe({"sampler/entropy": 5.0})
    assert sched(1)[0] == pytest.approx(1e-4)
    state = sched.state_dict()
    other = Schedule(cfg, 10)
    other.load_state_dict(state)
    assert other(3)[0] == sched(3)[0]


@pytest.mark.parametrize("target, want", [("entropy", 1.2 * 0.3), ("entropy_gain", 0.2 * 0.3)])
def test_a_relative_target_is_a_multiple_of_the_entropy_at_step_0(target, want):
    cfg = NoiseConfig(schedule="adaptive", target=target, target_value=1.2, target_relative=True)
    sched = Schedule(cfg, 40)
    measured = "sampler/entropy" if target == "entropy" else "entropy_gain"
    first = sched.observe({"entropy": 0.3, measured: want})
    assert first["noise/target"] == pytest.approx(want) and first["noise/target_error"] == pytest.approx(0)
    assert sched(1)[0] == pytest.approx(cfg.sigma)  # on target: sigma stays
    later = sched.observe({"entropy": 0.9, measured: 0.0})  # H0 is the first step's, whatever comes later
    assert later["noise/target"] == pytest.approx(want) and sched(2)[0] > cfg.sigma
    resumed = Schedule(cfg, 40)
    resumed.load_state_dict(sched.state_dict())
    assert resumed.set_point() == pytest.approx(want)


def test_a_sigma_held_at_a_bound_for_a_tenth_of_the_run_warns_once():
    cfg = NoiseConfig(schedule="adaptive", sigma=1e-2, target_value=0.5, target_relative=False, sigma_max=2e-2)
    sched = Schedule(cfg, 50)
    lines = []
    for _ in range(20):
        sched.observe({"sampler/entropy": 0.0})  # out of reach: sigma climbs to sigma_max and stays
        lines.append(sched.pinned_warning())
    warned = [line for line in lines if line]
    assert len(warned) == 1 and lines.index(warned[0]) == 5  # 2 steps to the bound, then 5 held
    assert warned[0] == ("warning: noise=adaptive has held sigma at noise.sigma_max (0.02) for 5 steps: the sampler "
                         "entropy target (0.5 nats) is out of its reach; lower noise.target_value or raise noise.sigma_max")
    resumed = Schedule(cfg, 50)
    resumed.load_state_dict(sched.state_dict())
    resumed.observe({"sampler/entropy": 0.0})
    assert resumed.pinned_warning() is None


def _tiny_model():
    return tiny_qwen2(vocab=64, hidden=64, inter=128)


def test_noise_goes_to_the_two_norms_per_block_only():
    model = _tiny_model()
    names = [n for n, _ in noisy_norms(model, include_final_norm=False)]
    assert names == [f"model.layers.{i}.{k}" for i in range(2) for k in ("input_layernorm", "post_attention_layernorm")]
    assert "model.norm" in [n for n, _ in noisy_norms(model, include_final_norm=True)]


def test_a_family_whose_mlp_pre_norm_has_another_name_gets_aqn_on_that_norm(monkeypatch):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # Gemma 2's block names its MLP pre-norm pre_feedforward_layernorm; its post_attention_layernorm
    # normalises attention's output, after o_proj: noise there would reach no gate or up input
    monkeypatch.setitem(ARCHITECTURES, "gemma2", Architecture("gemma2", "Gemma2Config",
                                                              mlp_norm="pre_feedforward_layernorm"))
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=32)).eval()
    names = [n for n, _ in noisy_norms(model, include_final_norm=False)]
    assert names == [f"model.layers.{i}.{k}" for i in range(2) for k in ("input_layernorm", "pre_feedforward_layernorm")]
    layer = model.model.layers[0]
    seen: dict[str, torch.Tensor] = {}
    hooks = [getattr(layer.mlp, p).register_forward_hook(lambda mod, inp, out, p=p: seen.__setitem__(p, inp[0].clone()))
             for p in ("gate_proj", "up_proj")]
    x = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        model(x)
        clean = dict(seen)
        post_attention = layer.post_attention_layernorm.weight.clone()
        aqn = AQN(model, NoiseConfig(schedule="fixed", sigma=0.1), seed=0)
        aqn.draw(0.1)
        with aqn.applied():
            assert torch.equal(layer.post_attention_layernorm.weight, post_attention)
            model(x)
    for h in hooks:
        h.remove()
    gate, up = (seen[p] / clean[p] for p in ("gate_proj", "up_proj"))
    assert torch.allclose(gate, up) and (gate - 1).abs().max() > 1e-3  # one shared draw, in front of gate and up


def test_q_k_v_share_one_noise_vector_and_o_proj_gets_none():
    """Record each projection's input with and without noise: q, k, v inputs move by one shared
    factor (1 + z / gamma), o_proj's input does not move when attention is fixed."""
    model = _tiny_model()
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, n=n: seen.__setitem__(n, inp[0].detach().clone()))
             for n, m in model.named_modules() if n.startswith("model.layers.0.") and n.endswith("_proj")]
    x = torch.randint(0, 64, (1, 5))
    model(x)
    clean = dict(seen)
    aqn = AQN(model, NoiseConfig(schedule="fixed", sigma=0.1), seed=0)
    aqn.draw(0.1)
    with aqn.applied():
        model(x)
    noisy = dict(seen)
    for h in hooks:
        h.remove()
    prefix = "model.layers.0."
    q, k, v = (noisy[f"{prefix}self_attn.{p}_proj"] / clean[f"{prefix}self_attn.{p}_proj"] for p in "qkv")
    assert torch.allclose(q, k) and torch.allclose(k, v)
    gamma = model.model.layers[0].input_layernorm.weight
    assert torch.allclose(q[0, 0], 1 + aqn.draws[0] / gamma, atol=1e-4)
    # gate and up share the second vector (post_attention_layernorm)
    g = noisy[f"{prefix}mlp.gate_proj"] / clean[f"{prefix}mlp.gate_proj"]
    u = noisy[f"{prefix}mlp.up_proj"] / clean[f"{prefix}mlp.up_proj"]
    assert torch.allclose(g, u)
    assert not torch.allclose(g[0, 0], q[0, 0])


def test_o_proj_and_down_proj_weights_untouched_and_norms_restored_bit_for_bit():
    model = _tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    aqn = AQN(model, NoiseConfig(schedule="fixed", sigma=0.05), seed=3)
    for _ in range(3):
        aqn.draw(0.05)
        with aqn.applied():
            for n, p in model.named_parameters():
                if "layernorm" in n:
                    assert not torch.equal(p, before[n])
                else:
                    assert torch.equal(p, before[n]), n
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_sigma_zero_changes_nothing_and_sigma_positive_changes_logits():
    model = _tiny_model()
    x = torch.randint(0, 64, (2, 7))
    clean = model(x).logits
    aqn = AQN(model, NoiseConfig(schedule="fixed"), seed=0)
    aqn.draw(0.0)
    with aqn.applied():
        assert torch.equal(model(x).logits, clean)
    aqn.draw(1e-2)
    with aqn.applied():
        assert not torch.allclose(model(x).logits, clean)
    assert torch.equal(model(x).logits, clean)


def test_resample_per_forward_draws_anew():
    model = _tiny_model()
    x = torch.randint(0, 64, (1, 4))
    aqn = AQN(model, NoiseConfig(schedule="fixed", resample="forward"), seed=0)
    aqn.draw(0.05)
    with aqn.applied(model):
        a, b = model(x).logits, model(x).logits
    assert not torch.allclose(a, b)
    per_step = AQN(model, NoiseConfig(schedule="fixed"), seed=0)
    per_step.draw(0.05)
    with per_step.applied(model):
        assert torch.equal(model(x).logits, model(x).logits)


def test_sampler_sees_noise_and_learner_does_not(tiny_policy):
    """The run loop's own rollout path: generate() logits move under AQN, the learner's forward
    after the block is the clean one."""
    from qerl_exp.decoders.scoring import completion_logits
    from qerl_exp.rl.rollout import HFGenerator, sample

    cfg, task, models = tiny_policy
    policy, tok = models.policy, models.tokenizer
    prompts = [tok.render_prompt(p.question, "") for p in task.sample(2, __import__("numpy").random.default_rng(0))]
    algo = cfg.algo
    torch.manual_seed(0)
    clean = sample(HFGenerator(policy, tok), tok, prompts, algo, torch.device("cpu"))
    learner_before = completion_logits(policy, clean, algo.temperature)
    aqn = AQN(policy, NoiseConfig(schedule="fixed"), seed=0)
    aqn.draw(5e-2)
    with aqn.applied(policy):
        noisy_logits = completion_logits(policy, clean, algo.temperature)  # the sampler's view of the same tokens
        torch.manual_seed(0)
        noisy = sample(HFGenerator(policy, tok), tok, prompts, algo, torch.device("cpu"))
    assert not torch.allclose(noisy_logits, learner_before)
    assert not torch.allclose(noisy.sampler_entropy.sum(), clean.sampler_entropy.sum())
    assert torch.equal(completion_logits(policy, clean, algo.temperature), learner_before)
    assert math.isfinite(float(noisy.sampler_logp.sum()))


def test_a_sigma_large_against_a_norm_scale_is_named_in_one_warning():
    model = _tiny_model()
    paper = NoiseConfig(schedule="exp", sigma_start=1e-2, sigma_end=5e-4)
    gammas = [m.weight.abs().median().item() for _, m in noisy_norms(model, False)]
    assert 1e-2 / min(gammas) <= SCALE_WARNING and AQN(model, paper, seed=0).scale_warning() is None
    with torch.no_grad():  # layer 1's input norm at SmolLM2's layer-0 scale
        dict(noisy_norms(model, False))["model.layers.1.input_layernorm"].weight.fill_(0.02)
    warning = AQN(model, paper, seed=0).scale_warning()
    assert warning.startswith("warning: AQN's sigma (0.01) is 50% of the median |gamma| of model.layers.1.input_layernorm "
                              "(0.02): ") and warning.endswith("lower noise.sigma_start (and the schedule's other sigmas), or set noise.relative=true")
    assert "\n" not in warning
    assert AQN(model, NoiseConfig(schedule="none"), seed=0).scale_warning() is None
    assert "lower noise.sigma " in AQN(model, NoiseConfig(schedule="fixed", sigma=5e-3), seed=0).scale_warning()
    assert AQN(model, NoiseConfig(schedule="fixed", sigma=1e-3), seed=0).scale_warning() is None  # 5 %


def _median(values: list[float]) -> float:
    """The median by its definition: the middle value, or the mean of the two middle ones."""
    xs, mid = sorted(values), len(values) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


@pytest.mark.parametrize("relative", [True, False])
def test_each_norm_gets_noise_of_the_effective_sigma(relative):
    """Relative: the std of gamma_noisy - gamma per norm is sigma * median|gamma| of that norm's
    clean scale (the final norm included); absolute: sigma for every norm, whatever its scale."""
    model = _tiny_model()
    norms = noisy_norms(model, include_final_norm=True)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # scales of different sizes and signs, as SmolLM2's 0.02-0.4
        for i, (_, m) in enumerate(norms):
            m.weight.copy_((torch.rand(m.weight.shape, generator=generator) - 0.2) * 0.05 * (i + 1))
    clean = [m.weight.detach().clone() for _, m in norms]
    sigma = 0.1
    aqn = AQN(model, NoiseConfig(schedule="fixed", sigma=sigma, relative=relative, include_final_norm=True), seed=0)
    deltas = [[] for _ in norms]
    for _ in range(200):  # 200 draws x 64 entries a norm: the std within 1 % or so
        aqn.draw(sigma)
        with aqn.applied():
            for d, (_, m), c in zip(deltas, norms, clean):
                d.append((m.weight - c).detach().double())
    expected = [sigma * _median([abs(v) for v in c.tolist()]) if relative else sigma for c in clean]
    measured = [torch.cat(d).std().item() for d in deltas]
    assert measured == pytest.approx(expected, rel=0.03)
    assert len(set(round(e, 6) for e in expected)) == (len(norms) if relative else 1)
    # the logged spread: min, median and max of those effective sigmas
    from qerl_exp.rl.metrics import noise_metrics

    logged = noise_metrics(sigma, 1, aqn.scales)
    assert logged["noise/sigma"] == sigma
    assert [logged[f"noise/sigma_eff_{k}"] for k in ("min", "median", "max")] == pytest.approx(
        [min(expected), _median(expected), max(expected)], rel=1e-6)


def test_relative_sigma_warns_in_its_own_units():
    model = _tiny_model()
    with torch.no_grad():  # a model of SmolLM2's smallest norm scale everywhere
        for _, m in noisy_norms(model, False):
            m.weight.fill_(0.02)
    paper = dict(schedule="exp", sigma_start=1e-2, sigma_end=5e-4)
    absolute = AQN(model, NoiseConfig(**paper), seed=0).scale_warning()
    assert absolute.endswith("or set noise.relative=true") and "50% of the median |gamma|" in absolute
    assert AQN(model, NoiseConfig(**paper, relative=True), seed=0).scale_warning() is None  # 1 % of each scale
    warning = AQN(model, NoiseConfig(schedule="fixed", sigma=0.3, relative=True), seed=0).scale_warning()
    assert warning.startswith("warning: AQN's relative sigma (0.3, noise.relative=true) is 30% of every noised norm's "
                              "median |gamma|: ") and warning.endswith("lower noise.sigma (and the schedule's other sigmas)")
