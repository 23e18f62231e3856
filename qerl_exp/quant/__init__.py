"""Quantize the frozen base: replace decoder linears by 4-bit layers, and count their bytes.

A weight format is one module here, its name(s) in `FORMATS` (which `config.QUANT_FORMATS` lists
too, for validation). The module holds the format's linear layer and a `Handler` whose
`quantize_linear(linear)` makes one. The layer is a frozen `nn.Linear` subclass whose `weight` is
its 4-bit codes (so peft attaches LoRA to it with a plain `LoraConfig`), with what every reader of
a base asks of it:
- `dequantize(dtype, out=None)`: the dense `[out, in]` weight it multiplies by (the learner's
  products; `out` a buffer the format may decode into);
- `runtime_weight()`: the weight in the rollout engine's kernel layout (`layout.KernelWeight`);
  a format without it runs through HF's generate only;
- `quantized_bytes()`: everything it stores;
- optionally `dequantize_stacked(layers, out)`: several layers decoded into one buffer at once.

Formats: `nvfp4` and `mxfp4` (`fp4`: our own packing; `docs/quant.md` has the layout), `nf4`
(`nf4`: bitsandbytes, optionally with double quant). `quantize_model` walks the decoder blocks and
swaps in the quantized layers; embeddings, norms and lm_head stay in the compute dtype.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from qerl_exp.config import QuantConfig

# format name -> its module (imported when the format is used: nf4 loads bitsandbytes)
FORMATS = {"nvfp4": "qerl_exp.quant.fp4", "mxfp4": "qerl_exp.quant.fp4", "nf4": "qerl_exp.quant.nf4"}


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _handler(cfg: QuantConfig, compute_dtype: torch.dtype):
    if cfg.format not in FORMATS:
        raise ValueError(f"quant.format={cfg.format!r} has no handler; valid: none, {', '.join(sorted(FORMATS))}")
    module = importlib.import_module(FORMATS[cfg.format])
    if cfg.format == "nf4":
        return module.Handler(cfg.format, compute_dtype, double_quant=cfg.double_quant)
    return module.Handler(cfg.format, compute_dtype)


def decoder_linears(model: nn.Module, targets: list[str]) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """(name, parent, attribute, module) for each targeted linear inside the decoder blocks; a
    decoder block itself (a module with `self_attn` and `mlp`) counts as inside."""
    found = []
    is_block = hasattr(model, "self_attn") and hasattr(model, "mlp")
    for name, module in model.named_modules():
        parent_name, _, attr = name.rpartition(".")
        if attr in targets and (is_block or ".layers." in f".{parent_name}."):
            found.append((name, model.get_submodule(parent_name), attr, module))
    return found


def quantize_linear(linear: nn.Linear, cfg: QuantConfig, compute_dtype: torch.dtype) -> nn.Module:
    """One frozen quantized layer holding `linear`'s weights in `cfg.format`."""
    return _handler(cfg, compute_dtype).quantize_linear(linear)


def quantize_model(model: nn.Module, cfg: QuantConfig, compute_dtype: torch.dtype) -> nn.Module:
    """Replace the targeted decoder linears of `model` in place by frozen quantized layers.

    Args:
        model: a Llama/Qwen2-family causal LM (not yet wrapped by peft), or one decoder block.
        cfg: the quant config; `format=none` leaves the model unchanged.
        compute_dtype: the dtype activations are computed in.

    Returns:
        The same model object.
    """
    if cfg.format == "none":
        return model
    handler = _handler(cfg, compute_dtype)
    noise = torch.Generator().manual_seed(0) if cfg.fake == "noise" else None
    for _, parent, attr, linear in decoder_linears(model, cfg.targets):
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


def _is_format(module: nn.Module) -> bool:
    """A weight format's layer (it decodes itself), looked up on the class: peft's wrappers forward
    unknown attributes to their base layer."""
    return callable(getattr(type(module), "quantized_bytes", None))


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
    w = module.dequantize(dtype, out=out) if _is_format(module) else module.weight.to(dtype)
    if out is None or w.data_ptr() == out.data_ptr():
        return w if out is None else out
    return out.copy_(w)


def stacked_base_weight(modules: list[nn.Module], dtype: torch.dtype) -> torch.Tensor:
    """The [sum of out, in] matrix of frozen linears fed one input (a projection group), their
    `base_weight`s one after another by rows, in a new tensor (in one launch where the format
    decodes several layers at once: NVFP4 on CUDA)."""
    rows = [m.out_features for m in modules]
    out = torch.empty(sum(rows), modules[0].in_features, dtype=dtype, device=modules[0].weight.device)
    stacked = getattr(type(modules[0]), "dequantize_stacked", None)
    if stacked is not None and all(type(m) is type(modules[0]) for m in modules):
        return stacked(modules, out)
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
        if _is_format(module):
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
