"""Synthetic models: built from the config's dims (`model.source=synthetic`), nothing downloaded.

The embedded tiny model (`model=tiny`, warmed up on the task by `models.warmup`) and the shape
presets (`model=qwen2.5-{7b,14b,32b}-shape`: a real model's decoder and vocabulary with random
weights, for memory and speed at scale) are both made here: `hf_config` turns the dims into the
config of the model's family (any declared architecture), `build` makes the model at its seeded initialization, on the meta device
and block by block when each block is to be quantized as soon as it exists.
"""

from __future__ import annotations

from typing import Callable

import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from qerl_exp.config import architectures
from qerl_exp.config import ModelConfig
from qerl_exp.config.architectures import ARCHITECTURES

SEED = 1234  # a synthetic model is a fixed artifact, independent of the run's seed (its warm-up draws from it too)
SEED_STRIDE = 1000  # base k (`model.warmup.seed`) draws from SEED + 1000 k: its init, warm-up data and probe


def base_seed(cfg: ModelConfig) -> int:
    """The seed of a synthetic model's initialization and of its warm-up's draws."""
    return SEED + SEED_STRIDE * cfg.warmup.seed


def hf_config(cfg: ModelConfig, vocab_size: int) -> PretrainedConfig:
    """The HF config of a synthetic model: its family's config class with the dims.

    Args:
        cfg: the model config (`family` and the sizes).
        vocab_size: the tokenizer's vocabulary.

    Returns:
        An instance of the family's `Architecture.config_class` (`Qwen2Config`, ...).
    """
    cls = getattr(transformers, ARCHITECTURES[cfg.family].config_class)
    return cls(
        head_dim=cfg.hidden_size // cfg.num_heads,  # Qwen3's default is 128 whatever the width
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=cfg.tie_embeddings,
        pad_token_id=0,
    )


def build(cfg: ModelConfig, vocab_size: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
          on_block: Callable[[nn.Module], None] | None = None):
    """A synthetic model at its seeded random initialization, created on `device` in `dtype`;
    the global RNG (CPU and `device`'s) is left as it was.

    Args:
        cfg: the model config.
        vocab_size: the tokenizer's vocabulary (`cfg.vocab_size`, when set, wins).
        device: where the weights are made.
        dtype: their dtype.
        on_block: called on each decoder block right after it is made (e.g. to quantize it), so
            that at most one block exists in `dtype` at a time: the model is laid out on the meta
            device and made block by block.
    """
    device = torch.device(device)
    config = hf_config(cfg, cfg.vocab_size or vocab_size)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(base_seed(cfg))
        if on_block is None:
            with device:
                return AutoModelForCausalLM.from_config(config, dtype=dtype)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        inner, blocks = architectures.body(model), architectures.layers(model)
        for name, child in inner.named_children():
            if name == "rotary_emb":  # its buffers are computed at construction: make it anew
                with device:
                    inner.rotary_emb = type(child)(config=config)
            elif child is not inner.layers:
                _materialize(child, device, config.initializer_range)
        if not config.tie_word_embeddings:
            _materialize(model.lm_head, device, config.initializer_range)
        model.tie_weights()
        for block in blocks:
            _materialize(block, device, config.initializer_range)
            on_block(block)
        return model


def _materialize(module: nn.Module, device: torch.device, std: float) -> None:
    """Allocate a meta module's tensors on `device` and initialise them as HF's Llama/Qwen2 do:
    linears and embeddings N(0, std), norm scales 1, biases 0."""
    module.to_empty(device=device)
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False):
            if isinstance(m, (nn.Linear, nn.Embedding)) and name == "weight":
                nn.init.normal_(p, std=std)
            elif "norm" in type(m).__name__.lower():
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)
