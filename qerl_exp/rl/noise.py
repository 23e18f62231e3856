"""Adaptive Quantization Noise (AQN): where the noise goes, and how large it is at each step.

Placement (paper; docs/method.md, section 2): for each decoder block, one Gaussian vector z ~ N(0, sigma^2 I)
is added to the scale (gamma) of the RMSNorm before attention (`input_layernorm` in Llama and Qwen),
which feeds q, k and v, and another to the one before the MLP (`post_attention_layernorm` there),
which feeds gate and up; each family names its two in `qerl_exp.config.architectures`. o_proj and down_proj get none; the final
norm gets none unless `noise.include_final_norm`. This equals row-wise multiplicative noise on the
quantized weights: (z / gamma + 1) * RMSNorm(x).

Scale: the paper's sigma is absolute, so its effect, z / gamma, depends on the model's norm scales.
With `noise.relative` (ours) norm k's noise is z ~ N(0, (sigma * m_k)^2 I), m_k the median |gamma_k|
of its clean scale at setup (`AQN.scales`): the same schedule perturbs every model's linears' inputs
by about the same fraction.

Schedules (`sigma_at`), with K = num_stages stages of equal length, stage k = floor(step * K / steps):
- `none`: sigma = 0.  `fixed`: sigma = `noise.sigma` at every step.
- decaying schedules: stage 0 is noise-free; stage k >= 1 uses t = (k - 1) / D, with
  D = K - 1 (`denominator: paper`, Eq. 8) or K - 2 (`code`, so the last stage reaches sigma_end):
  - `exp`:    sigma_start * (sigma_end / sigma_start) ** t                       (paper Eq. 8)
  - `linear`: sigma_start + (sigma_end - sigma_start) * t
  - `cosine`: sigma_end + (sigma_start - sigma_end) * (1 + cos(pi * t)) / 2
  - `log`:    sigma_start - (sigma_start - sigma_end) * ln(1 + 9 t) / ln(10)   (falls fast, then flattens)
  The paper's Fig. 15 names linear, cosine and logarithmic decays without formulas; these are ours.
- `adaptive` (our extension, not the paper's method): a bounded controller. It starts at
  `noise.sigma` and after each step moves log(sigma) by gain * (target - measured) / target,
  where measured is the step's `sampler/entropy` (or `entropy_gain`), clamped to
  [sigma_min, sigma_max]. Too little entropy raises sigma, too much lowers it. With
  `noise.target_relative` (the default) the target is set from the model's own entropy H0 (the
  learner's, without noise) on the first step's rollout: `target_value * H0` for `entropy`,
  `(target_value - 1) * H0` for `entropy_gain`, so that target_value is the wanted sampler entropy
  as a multiple of the model's own either way. A sigma that sits at a bound for a tenth of the run
  means the target is out of reach: `Schedule.pinned_warning` says so, once.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from qerl_exp.config import architectures
from qerl_exp.config import NoiseConfig
from qerl_exp.rl.metrics import noise_controller_metrics


def stage_of(step: int, total_steps: int, num_stages: int) -> int:
    """The stage (0..K-1) of a 0-based step when `total_steps` are split into K equal stages."""
    return min(step * num_stages // total_steps, num_stages - 1)


def decay(cfg: NoiseConfig, t: float) -> float:
    """The decaying schedule's sigma at progress t in [0, 1] from sigma_start to sigma_end."""
    a, b = cfg.sigma_start, cfg.sigma_end
    if cfg.schedule == "exp":
        return a * (b / a) ** t
    if cfg.schedule == "linear":
        return a + (b - a) * t
    if cfg.schedule == "cosine":
        return b + (a - b) * (1 + math.cos(math.pi * t)) / 2
    if cfg.schedule == "log":
        return a - (a - b) * math.log1p(9 * t) / math.log(10)
    raise ValueError(f"noise.schedule={cfg.schedule!r} is not a decaying schedule")


def sigma_at(cfg: NoiseConfig, step: int, total_steps: int) -> tuple[float, int]:
    """`(sigma, stage)` of the open-loop schedules at a 0-based step (adaptive: its start)."""
    stage = stage_of(step, total_steps, cfg.num_stages)
    if cfg.schedule == "none":
        return 0.0, stage
    if cfg.schedule in ("fixed", "adaptive"):
        return cfg.sigma, stage
    if stage == 0:
        return 0.0, 0
    denominator = cfg.num_stages - 1 if cfg.denominator == "paper" else cfg.num_stages - 2
    return decay(cfg, (stage - 1) / denominator), stage


# AQN's effect is relative to the norm scale (z / gamma). On SmolLM2-135M the paper's absolute
# sigma_start, 45 % of its smallest median |gamma|, did not learn (results/results.md). Where the
# noise's standard deviation exceeds this fraction of a noised norm's median |gamma|, a run starts
# with a warning.
SCALE_WARNING = 0.1


def planned_sigma(cfg: NoiseConfig) -> tuple[float, str]:
    """The largest sigma the schedule plans (adaptive: its start; the controller then follows the
    entropy), and the option that sets it."""
    if cfg.schedule == "none":
        return 0.0, "noise.schedule"
    if cfg.schedule in ("fixed", "adaptive"):
        return cfg.sigma, "noise.sigma"
    return max(cfg.sigma_start, cfg.sigma_end), "noise.sigma_start"


class Schedule:
    """The sigma of each step; for `adaptive`, also the controller state (`state_dict`)."""

    def __init__(self, cfg: NoiseConfig, total_steps: int):
        self.cfg, self.total_steps = cfg, total_steps
        self.sigma = cfg.sigma  # adaptive controller state
        self.own_entropy: float | None = None  # H0, the relative target's unit
        self.pinned = 0  # consecutive steps the controller's sigma ended at a bound
        self.warned = False

    def __call__(self, step: int) -> tuple[float, int]:
        sigma, stage = sigma_at(self.cfg, step, self.total_steps)
        return (self.sigma, stage) if self.cfg.schedule == "adaptive" else (sigma, stage)

    def set_point(self) -> float | None:
        """The controller's target for the measured quantity (None until H0 is known)."""
        if not self.cfg.target_relative:
            return self.cfg.target_value
        if self.own_entropy is None:
            return None
        return (self.cfg.target_value - (self.cfg.target == "entropy_gain")) * self.own_entropy

    def observe(self, metrics: dict[str, float]) -> dict[str, float]:
        """Feed the step's metrics to the controller; returns its state to log."""
        if self.cfg.schedule != "adaptive":
            return {}
        own = metrics.get("entropy")
        if self.own_entropy is None and own is not None and math.isfinite(own):
            self.own_entropy = own
        target = self.set_point()
        measured = metrics.get("sampler/entropy" if self.cfg.target == "entropy" else "entropy_gain")
        if target is None or measured is None or not math.isfinite(measured):
            return noise_controller_metrics(float("nan"), float("nan") if target is None else target)
        error = target - measured
        step = self.cfg.gain * error / max(abs(target), 1e-3)
        self.sigma = min(max(self.sigma * math.exp(step), self.cfg.sigma_min), self.cfg.sigma_max)
        self.pinned = self.pinned + 1 if self.sigma in (self.cfg.sigma_min, self.cfg.sigma_max) else 0
        return noise_controller_metrics(error, target)

    def pinned_warning(self) -> str | None:
        """One line, the first time the controller's sigma has sat at a bound for a tenth of the
        run's steps: the target is out of the reach of [sigma_min, sigma_max]."""
        if self.warned or self.pinned < max(1, math.ceil(self.total_steps / 10)):
            return None
        self.warned = True
        at_max = self.sigma == self.cfg.sigma_max
        bound = "noise.sigma_max" if at_max else "noise.sigma_min"
        fix = ("lower noise.target_value or raise noise.sigma_max" if at_max else
               "raise noise.target_value or lower noise.sigma_min")
        what = "sampler entropy" if self.cfg.target == "entropy" else "entropy gain"
        return (f"warning: noise=adaptive has held sigma at {bound} ({self.sigma:g}) for {self.pinned} steps: the "
                f"{what} target ({self.set_point():.3g} nats) is out of its reach; {fix}")

    def state_dict(self) -> dict:
        return {"sigma": self.sigma, "own_entropy": self.own_entropy, "pinned": self.pinned, "warned": self.warned}

    def load_state_dict(self, state: dict) -> None:
        self.sigma = float(state["sigma"])
        self.own_entropy = state.get("own_entropy")
        self.pinned, self.warned = state.get("pinned", 0), state.get("warned", False)


def noisy_norms(model: nn.Module, include_final_norm: bool) -> list[tuple[str, nn.Module]]:
    """The RMSNorms that receive AQN, in model order, named as in `model`: each block's two pre-norms
    (its family's, `architectures.pre_norms`), then the final norm when included.

    Raises:
        architectures.UnsupportedModel: the model's family is not declared.
    """
    norms = [m for pair in architectures.pre_norms(model) for m in pair]
    if include_final_norm:
        norms.append(architectures.final_norm(model))
    names = {id(m): name for name, m in model.named_modules()}
    return [(names[id(m)], m) for m in norms]


class AQN:
    """Adds the current draw to the norm scales inside `applied()`, and restores them bit for bit.

    Args:
        model: the sampling policy.
        cfg: the noise config (placement options).
        seed: seeds the noise generator (its own stream, so noise never shifts sampling RNG).
    """

    def __init__(self, model: nn.Module, cfg: NoiseConfig, seed: int):
        self.cfg = cfg
        # without noise no norm is needed: a family with other norms (GPT-2's LayerNorm) runs noise-free
        self.norms = noisy_norms(model, cfg.include_final_norm) if cfg.schedule != "none" else []
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.sigma = 0.0
        self.draws: list[torch.Tensor] = []
        self.medians = [torch.quantile(m.weight.detach().float().abs(), 0.5).item() for _, m in self.norms]
        # each norm's factor on sigma: its noise's standard deviation is sigma * scale
        self.scales = list(self.medians) if cfg.relative else [1.0] * len(self.norms)

    def scale_warning(self) -> str | None:
        """One line when the planned noise's standard deviation exceeds `SCALE_WARNING` of a noised
        norm's median |gamma| (named: the norm where it perturbs its linears' inputs the most)."""
        sigma, option = planned_sigma(self.cfg)
        if not self.norms:  # no noise
            return None
        if self.cfg.relative:
            if sigma <= SCALE_WARNING:
                return None
            return (f"warning: AQN's relative sigma ({sigma:g}, noise.relative=true) is {sigma:.0%} of every noised "
                    f"norm's median |gamma|: noise that large did not learn on SmolLM2-135M (results/results.md); "
                    f"lower {option} (and the schedule's other sigmas)")
        gamma, name = min(zip(self.medians, (n for n, _ in self.norms)))
        ratio = sigma / max(gamma, 1e-12)
        if ratio <= SCALE_WARNING:
            return None
        return (f"warning: AQN's sigma ({sigma:g}) is {ratio:.0%} of the median |gamma| of {name} ({gamma:.3g}): "
                f"noise that large did not learn on SmolLM2-135M (results/results.md); lower {option} "
                "(and the schedule's other sigmas), or set noise.relative=true")

    def draw(self, sigma: float) -> None:
        """A fresh noise vector per norm, shared by every completion of the rollout step."""
        self.sigma = sigma
        self.draws = [
            (torch.randn(m.weight.shape, generator=self.generator) * (sigma * scale)).to(m.weight.device, m.weight.dtype)
            for (_, m), scale in zip(self.norms, self.scales)
        ]

    @contextmanager
    def applied(self, model: nn.Module | None = None):
        """Noise on inside the block; with `resample=forward`, a new draw before each forward of `model`."""
        if self.sigma == 0.0:
            yield
            return
        clean = [m.weight.detach().clone() for _, m in self.norms]
        handle = None

        def perturb():
            with torch.no_grad():
                for (_, m), c, z in zip(self.norms, clean, self.draws):
                    m.weight.copy_(c).add_(z)

        def redraw(*_):
            self.draw(self.sigma)
            perturb()

        if self.cfg.resample == "forward" and model is not None:
            handle = model.register_forward_pre_hook(redraw)
        try:
            perturb()
            yield
        finally:
            if handle is not None:
                handle.remove()
            with torch.no_grad():
                for (_, m), c in zip(self.norms, clean):
                    m.weight.copy_(c)
