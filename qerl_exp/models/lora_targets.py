"""LoRA targets as peft takes them, checked against the model before a run starts.

`lora.targets` is peft's `target_modules`: module names, each matching every module whose name is it
or ends with `.<name>` (`q_proj`, `self_attn.v_proj`, GPT-2's `c_attn`), or `[all-linear]`, peft's
every linear layer but the output head. What runs them:
- the harness's own decoders (the padding-free learner and the CUDA engine, over the architectures
  `qerl_exp.config.architectures` declares) apply adapters on the decoder blocks' projections (q, k, v, o, gate,
  up, down), any subset of them: a projection without an adapter counts as a zero-rank one;
- HF's forward through peft (`train.padding_free=false rollout.engine=hf`) runs any module peft
  can adapt, of any causal LM.

`check` builds the model's skeleton on the meta device (no weights: its config alone, from the
checkpoint folder, the hub cache or a synthetic model's dims) and refuses, in one line, an
architecture the decoders do not read, an entry that matches no module, a module peft cannot adapt
(asked of peft itself, on the skeleton), and, where the decoders run, a module outside the blocks'
projections: all before the run directory is written. A GGUF checkpoint is checked when it is loaded (its config lies in the file).
"""

from __future__ import annotations

from torch import nn

from qerl_exp.config import architectures
from qerl_exp.config import DECODER_LINEARS, Config, LoraConfig
from qerl_exp.config.schema import ConfigError

ALL_LINEAR = "all-linear"


def peft_targets(cfg: LoraConfig) -> list[str] | str:
    """`lora.targets` as peft's `target_modules`: the names, or its `all-linear` shorthand."""
    return ALL_LINEAR if list(cfg.targets) == [ALL_LINEAR] else list(cfg.targets)


def uses_decoders(cfg: Config, cuda: bool) -> bool:
    """Whether a run of `cfg` computes the policy with the harness's decoders (the padding-free
    learner, or the CUDA engine: `rollout.engine=fast`, or `auto` where CUDA is)."""
    return cfg.train.padding_free or cfg.rollout.engine == "fast" or (cfg.rollout.engine == "auto" and cuda)


def skeleton(cfg: Config) -> nn.Module | None:
    """The run's causal LM on the meta device (its modules, no weights); None for a GGUF checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qerl_exp.models.synthetic import hf_config
    from qerl_exp.models.tokenizers import CharTokenizer

    model = cfg.model
    if model.source == "synthetic":
        config = hf_config(model, model.vocab_size or len(CharTokenizer()))
    elif model.gguf_file:
        return None
    else:
        config = AutoConfig.from_pretrained(model.name)  # a folder, or a hub id found in the cache (`preflight`)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def matches(model: nn.Module, lora: LoraConfig) -> dict[str, list[str]]:
    """Per entry of `lora.targets` (`all-linear` once), the names of the modules it matches, by peft's rules."""
    from peft import LoraConfig as PeftLoraConfig
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers, check_target_module_exists

    names = [n for n, _ in model.named_modules() if n]
    out = {}
    for entry in lora.targets:
        config = PeftLoraConfig(target_modules=ALL_LINEAR if entry == ALL_LINEAR else [entry])
        config = _maybe_include_all_linear_layers(config, model)  # all-linear: every linear layer but the head
        out[entry] = [n for n in names if check_target_module_exists(config, n)]
    return out


def check(cfg: Config, model: nn.Module, cuda: bool) -> None:
    """Refuse, before the run directory is written, an architecture or LoRA targets the run cannot train.

    Args:
        cfg: the run config.
        model: its model's skeleton (`skeleton`).
        cuda: whether the run's device is CUDA (`rollout.engine=auto` runs the CUDA engine there).

    Raises:
        ConfigError: one line naming the setting and what to change.
    """
    decoders = uses_decoders(cfg, cuda)
    if decoders:
        try:
            architectures.architecture(model.config)
        except architectures.UnsupportedModel as e:
            raise ConfigError(f"model.name={cfg.model.name}: {e}") from None
    found = matches(model, cfg.lora)
    modules = dict(model.named_modules())
    linears = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if _linear(m)})
    for entry, names in found.items():
        if not names:
            raise ConfigError(f"lora.targets entry {entry!r} names no module of this {model.config.model_type} model "
                              f"(its linear layers: {', '.join(linears)}; or [all-linear])")
        outside = [n for n in names if n.rsplit(".", 1)[-1] not in DECODER_LINEARS or ".layers." not in f".{n}"]
        if decoders and outside:
            raise ConfigError(f"lora.targets entry {entry!r} names {outside[0]}, outside the decoder blocks' projections "
                              f"({', '.join(DECODER_LINEARS)}) that the harness's decoders adapt; target those, or set "
                              f"{architectures.FALLBACK}")
    if any(not _linear(modules[n]) for names in found.values() for n in names):
        _peft_takes(model, cfg.lora)


def _linear(module: nn.Module) -> bool:
    """A linear layer (GPT-2's `Conv1D` too), which LoRA adapts on any path."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _peft_takes(model: nn.Module, lora: LoraConfig) -> None:
    """Let peft judge targets that are not linear layers (an embedding it adapts, a norm it refuses):
    adapters made on the skeleton, on the meta device."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    try:
        get_peft_model(model, PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=peft_targets(lora)))
    except ValueError as e:
        raise ConfigError(f"lora.targets={list(lora.targets)}: peft refuses them "
                          f"({str(e).strip().splitlines()[0][:200]})") from None
