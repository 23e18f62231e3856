"""Quantize the frozen base: replace decoder linears by 4-bit layers, and count their bytes.

A weight format is one module here, named beside the format in `config.QUANT_FORMATS` (the one list
of formats). The module holds the format's linear layer and a `Handler` whose
`quantize_linear(linear)` makes one. The layer is a frozen `nn.Linear` subclass whose `weight` is
its 4-bit codes (so peft attaches LoRA to it with a plain `LoraConfig`), and a `QuantizedLinear`:
what both readers of a base ask of it (the learner's `base_weight` / `stacked_base_weight`, the
rollout engine's `runtime_weight`) and the memory count (`quantized_bytes`).

Formats: `nvfp4` and `mxfp4` (`fp4`: our own packing; `docs/quant.md` has the layout), `nf4`
(`nf4`: bitsandbytes, optionally with double quant). `quantize_model` swaps in the quantized layers
at the projections the model's architecture declares (`architectures.projections`); embeddings,
norms and lm_head stay in the compute dtype.
"""

from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from qerl_exp.config import architectures
from qerl_exp.config import QUANT_FORMATS, QuantConfig
from qerl_exp.quant.layout import KernelWeight


@runtime_checkable
class QuantizedLinear(Protocol):
    """A weight format's layer, as every reader of a frozen base reads it (besides `in_features`,
    `out_features`, `bias` and `forward`, which it has as an `nn.Linear`).

    Both dispatchers test for it on the class (`is_quantized`): peft's wrappers forward unknown
    attributes to their base layer.
    """

    def dequantize(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """The dense `[out, in]` weight it multiplies by, in `dtype` (the learner's products); `out`
        a contiguous buffer the format may decode into (the caller copies when it did not)."""

    @staticmethod
    def dequantize_stacked(layers: list, out: torch.Tensor) -> torch.Tensor:
        """Several layers of this class decoded into `out` `[sum of out, in]`, one after another by
        rows (a projection group); returns `out`."""

    def runtime_weight(self) -> KernelWeight:
        """The weight in the rollout engine's kernel layout."""

    def quantized_bytes(self) -> int:
        """Everything the layer stores: codes, scales and their state, the bias."""


def is_quantized(module: nn.Module) -> bool:
    """A weight format's layer (`QuantizedLinear`), looked up on the class: a peft wrapper around one is not."""
    return issubclass(type(module), QuantizedLinear)


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _handler(cfg: QuantConfig, compute_dtype: torch.dtype):
    # the format's module is imported when the format is used: nf4 loads bitsandbytes
    module = importlib.import_module(QUANT_FORMATS[cfg.format])
    if cfg.format == "nf4":
        return module.Handler(cfg.format, compute_dtype, double_quant=cfg.double_quant)
    return module.Handler(cfg.format, compute_dtype)


def quantize_linear(linear: nn.Linear, cfg: QuantConfig, compute_dtype: torch.dtype) -> nn.Module:
    """One frozen quantized layer holding `linear`'s weights in `cfg.format`."""
    return _handler(cfg, compute_dtype).quantize_linear(linear)


def quantize_model(model: nn.Module, cfg: QuantConfig, compute_dtype: torch.dtype) -> nn.Module:
    """Replace the targeted decoder linears of `model` in place by frozen quantized layers.

    Args:
        model: a causal LM of a declared architecture (not yet wrapped by peft), or one decoder block.
        cfg: the quant config; `format=none` leaves the model unchanged.
        compute_dtype: the dtype activations are computed in.

    Returns:
        The same model object.
    """
    if cfg.format == "none":
        return model
    handler = _handler(cfg, compute_dtype)
    noise = torch.Generator().manual_seed(0) if cfg.fake == "noise" else None
    for parent, attr, linear in architectures.projections(model, cfg.targets):
        if type(linear) is not nn.Linear:  # already quantized layers (a block done while loading) stay
            continue
        if cfg.fake == "none":
            setattr(parent, attr, handler.quantize_linear(linear))
        else:
            _fake_quantize(linear, handler, noise)
    return model


@torch.no_grad()
def _fake_quantize(linear: nn.Linear, handler, noise: torch.Generator | None) -> None:
    """`quant.fake`: the dense weight replaced, in place, by its rounding to the handler's format
    (`noise` None) or by itself plus Gaussian noise with each output row's RMS rounding error
    (drawn on the CPU from `noise`, so every device gets the same draw)."""
    w = linear.weight.detach().float()
    rounded = dense_weight(handler.quantize_linear(linear)).to(w.device)
    if noise is None:
        new = rounded
    else:
        rms = (rounded - w).pow(2).mean(dim=1, keepdim=True).sqrt()
        new = w + torch.randn(w.shape, generator=noise).to(w.device) * rms
    linear.weight.copy_(new.to(linear.weight.dtype))


def base_weight(module: nn.Module, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The [out, in] matrix a frozen linear multiplies by, in `dtype`, for the learner's products:
    a dense layer's own weight (no copy when the dtype matches), a 4-bit one's decoded anew.

    Args:
        module: an `nn.Linear` or a weight format's layer.
        dtype: the activations' dtype.
        out: a contiguous [out, in] tensor (a slice of a stacked group's weight) to write into.

    Returns:
        The weight (`out` itself when given).
    """
    w = module.dequantize(dtype, out=out) if is_quantized(module) else module.weight.to(dtype)
    if out is None or w.data_ptr() == out.data_ptr():
        return w if out is None else out
    return out.copy_(w)


def stacked_base_weight(modules: list[nn.Module], dtype: torch.dtype) -> torch.Tensor:
    """The [sum of out, in] matrix of frozen linears fed one input (a projection group), their
    `base_weight`s one after another by rows, in a new tensor (in one launch where the format
    decodes several layers at once: NVFP4 on CUDA)."""
    rows = [m.out_features for m in modules]
    out = torch.empty(sum(rows), modules[0].in_features, dtype=dtype, device=modules[0].weight.device)
    if is_quantized(modules[0]) and all(type(m) is type(modules[0]) for m in modules):
        return type(modules[0]).dequantize_stacked(modules, out)
    for m, part in zip(modules, out.split(rows)):
        base_weight(m, dtype, out=part)
    return out


def dense_weight(module: nn.Module) -> torch.Tensor:
    """The weight of a linear, quantized or not, as a dense fp32 [out, in] matrix.

    Args:
        module: an `nn.Linear` or a weight format's layer (whose `weight` is its 4-bit codes, not the
            matrix).

    Returns:
        A new fp32 tensor: exactly what the layer multiplies by (before casting to the activations'
        dtype).
    """
    w = base_weight(module, torch.float32).detach()
    return w.clone() if w.data_ptr() == module.weight.data_ptr() else w  # a dense fp32 layer's own weight


def memory_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes the model stores: `mem/weights_bytes` (every parameter and buffer, quantized layers
    counted with all their scales and state) and `mem/quantized_linear_bytes`."""
    quantized = 0
    counted: set[int] = set()
    for module in model.modules():
        if is_quantized(module):
            quantized += module.quantized_bytes()
            counted.update(id(t) for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)))
    rest = 0
    seen: set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in counted or id(t) in seen:
            continue
        seen.add(id(t))
        rest += _tensor_bytes(t)
    return {"mem/weights_bytes": quantized + rest, "mem/quantized_linear_bytes": quantized}
