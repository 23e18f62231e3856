"""The policy's model: the base (synthetic or a real checkpoint), quantized, with LoRA.

`build_models(cfg, task, device)` is the entry point. It returns the policy (quantized base +
LoRA, the one that samples and learns), the tokenizer, and, when the noise monitor is on, the
full-precision reference (the unquantized base + a LoRA kept equal to the policy's).

Where the base comes from (`model.source`): `synthetic` models are built from the config's dims
(`synthetic`), the embedded tiny one warmed up on the task and cached (`warmup`); `pretrained`
ones are real checkpoints (`pretrained`: folders, the hub, GGUF files), read shard by shard where
each block is quantized as it arrives (`shards`). `tokenizers` holds the character tokenizer of
the tiny model and the adapter around a checkpoint's own.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qerl_exp.config import architectures
from qerl_exp.config import Config, LoraConfig, QuantConfig, TaskConfig
from qerl_exp.models.lora_targets import peft_targets, uses_decoders
from qerl_exp.models.pretrained import load_pretrained
from qerl_exp.models.synthetic import build
from qerl_exp.models.tokenizers import CharTokenizer, HFTokenizer
from qerl_exp.models.warmup import load_or_warm_up
from qerl_exp.quant import dense_weight, memory_bytes, quantize_linear, quantize_model
from qerl_exp.quant.fp4 import FP4Linear


def resolve_device(name: str, key: str = "train.device") -> torch.device:
    """`auto`, `cpu` or `cuda` as a device; `key` is the setting that chose it, named in the message."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{key}=cuda but no CUDA device is visible; use {key}=cpu or auto")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class RolloutModel:
    """The model rollouts come from: the policy itself (QeRL), or, when `rollout.quant` names a
    format, a separate copy of the base whose targeted linears hold the policy's base + LoRA merged
    and quantized to it. `sync()` after each update keeps either one equal to the policy.

    Args:
        policy: the peft-wrapped learner.
        separate: a copy of the base to quantize (`None`: the policy samples); synced at once.
        quant: the separate copy's format and targets.
        dtype: the compute dtype.
    """

    def __init__(self, policy: nn.Module, separate: nn.Module | None = None, quant: QuantConfig | None = None,
                 dtype: torch.dtype | None = None):
        self.policy, self.quant, self.dtype = policy, quant, dtype
        self.module = policy if separate is None else separate
        self.sync()

    def sync(self) -> None:
        """Bring the separate copy up to the policy's weights (nothing to do when it is the policy)."""
        if self.module is not self.policy:
            requantize_sampler(self.policy, self.module, self.quant, self.dtype)

    def weights_bytes(self) -> dict[str, int]:
        """`quant.memory_bytes` of the policy plus the separate copy's: the weights the strategy pays for."""
        weights = memory_bytes(self.policy)
        if self.module is not self.policy:
            separate = memory_bytes(self.module)
            weights = {k: v + separate[k] for k, v in weights.items()}
        return weights


@dataclass
class Models:
    """The models of a run; `sampler.module` samples (the policy itself unless `rollout.quant`
    asks for a separately quantized copy)."""

    policy: nn.Module
    tokenizer: CharTokenizer | HFTokenizer
    reference: nn.Module | None
    sampler: RolloutModel
    base_info: dict


def _load_base(cfg: Config, task, device: torch.device, dtype: torch.dtype, on_block=None):
    if cfg.model.source == "synthetic":
        tokenizer = CharTokenizer()
        if cfg.model.warmup.max_steps == 0:  # random weights, made where they run (7B: 28 GB in fp32 on CPU)
            model = build(cfg.model, len(tokenizer), device, dtype, on_block=on_block)
            return model, tokenizer, {"warmup": "none (random weights)", "blockwise": on_block is not None}
        model, info = load_or_warm_up(cfg.model, cfg.task, task, tokenizer)
        return model.to(device=device, dtype=dtype), tokenizer, info
    model, tokenizer, info = load_pretrained(cfg.model, dtype, device, on_block)
    tokenizer.use_chat(chat_template_text(cfg.task), cfg.task.chat_template_kwargs, cfg.task.text_prompts)
    return model, tokenizer, info


def chat_template_text(task: TaskConfig) -> str:
    """The chat template `task.chat_template` sets: its file's text, or the template itself; empty
    for none (the checkpoint's own)."""
    return Path(task.chat_template_file).expanduser().read_text() if task.chat_template_file else task.chat_template


def add_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Wrap `model` with trainable LoRA adapters; everything else is frozen."""
    # peft is imported where it is used, inside the run's logs.quiet block: its import loads torchao
    # and bitsandbytes, which print notices at import time.
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=peft_targets(cfg))
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as e:
        if "not found in the base model" not in str(e):
            raise
        raise ValueError(f"lora.targets={list(cfg.targets)} name no layer of {type(model).__name__}; "
                         "set lora.targets to the names of its linear layers") from None


def sync_lora(src: nn.Module, dst: nn.Module) -> None:
    """Copy the LoRA weights of `src` into `dst` (same adapter layout)."""
    src_params = {n: p for n, p in src.named_parameters() if "lora_" in n}
    with torch.no_grad():
        for n, p in dst.named_parameters():
            if "lora_" in n:
                p.copy_(src_params[n])


def build_models(cfg: Config, task, device: torch.device) -> Models:
    """Base model -> (reference copy) -> quantized policy -> LoRA on both.

    Args:
        cfg: the whole run config.
        task: the built task (the embedded model warms up on it).
        device: where the models live.

    Returns:
        `Models` with the policy, tokenizer, optional reference, and facts about the base.
    """
    dtype = resolve_dtype(cfg.model.dtype, device)
    # With no full-precision copy wanted, each block is quantized as soon as it exists, so loading
    # never holds more than the quantized model and one block.
    dense_copies = cfg.monitor.every > 0 or cfg.rollout.quant != "none"
    # (a fake-quantized base stays dense and is changed in place: once, after loading)
    blockwise = not dense_copies and cfg.quant.format != "none" and cfg.quant.fake == "none"
    on_block = (lambda block: quantize_model(block, cfg.quant, dtype)) if blockwise else None
    base, tokenizer, info = _load_base(cfg, task, device, dtype, on_block)
    # the padding-free learner and the CUDA engine (rollout.engine=fast, or auto on CUDA) compute its
    # blocks by hand, and quantization and AQN find their layers through its declared architecture:
    # refuse an undeclared family, or a variant the decoders do not compute, before anything reads it
    # (HF's forward alone, with neither, runs any causal LM)
    if uses_decoders(cfg, device.type == "cuda"):
        architectures.architecture(base.config)
    elif cfg.quant.format != "none" or cfg.rollout.quant != "none" or cfg.noise.schedule != "none":
        architectures.declared(base.config)
    base.requires_grad_(False)
    reference = copy.deepcopy(base) if cfg.monitor.every > 0 else None
    sampler_copy = copy.deepcopy(base) if cfg.rollout.quant != "none" else None
    policy = add_lora(quantize_model(base, cfg.quant, dtype), cfg.lora)
    if reference is not None:
        reference = add_lora(reference, cfg.lora)
        reference.requires_grad_(False)
        sync_lora(policy, reference)
    sampler = RolloutModel(policy, sampler_copy, QuantConfig(format=cfg.rollout.quant, targets=cfg.quant.targets), dtype)
    return Models(policy=policy, tokenizer=tokenizer, reference=reference, sampler=sampler, base_info=info)


@torch.no_grad()
def requantize_sampler(policy: nn.Module, sampler: nn.Module, quant: QuantConfig, dtype: torch.dtype) -> None:
    """Quantize the policy's current weights (base + LoRA, merged) into the sampler's linears:
    an NVFP4/MXFP4 layer already there is updated in place, anything else is replaced.

    Args:
        policy: the peft-wrapped learner (its base may itself be quantized).
        sampler: a plain copy of the base model whose targeted linears get replaced.
        quant: the sampler's format and targets.
        dtype: the compute dtype.
    """
    from peft.tuners.lora import LoraLayer  # imported on use, as in add_lora

    for (_, _, src), (parent, attr, _) in zip(architectures.projections(policy, quant.targets),
                                             architectures.projections(sampler, quant.targets), strict=True):
        base = src.get_base_layer() if isinstance(src, LoraLayer) else src
        weight = merged_weight(src)
        current = getattr(parent, attr)
        if isinstance(current, FP4Linear) and current.format == quant.format:
            current.requantize_(weight.to(dtype))  # in place: the rollout engine keeps its buffers and graphs
            continue
        # skip_init: nn.Linear's random init would draw from torch's RNG, which a resumed run has
        # just restored (its rollouts would then differ from the uninterrupted run's)
        merged = torch.nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=base.bias is not None,
                                          device=weight.device, dtype=dtype)
        merged.weight.copy_(weight)
        if base.bias is not None:
            merged.bias.copy_(base.bias)
        setattr(parent, attr, quantize_linear(merged, quant, dtype))


@torch.no_grad()
def merged_weight(layer: nn.Module) -> torch.Tensor:
    """The dense fp32 `[out, in]` weight a layer of the policy computes with: its base's (a 4-bit one
    decoded exactly as it multiplies, `quant.dense_weight`) plus its active LoRA adapters' deltas."""
    from peft.tuners.lora import LoraLayer  # imported on use, as in add_lora

    base = layer.get_base_layer() if isinstance(layer, LoraLayer) else layer
    weight = dense_weight(base).detach()
    if isinstance(layer, LoraLayer):
        for adapter in layer.active_adapters:
            weight = weight + layer.get_delta_weight(adapter).float()
    return weight
