"""Quantize the frozen base: replace decoder linears by 4-bit layers, and count their bytes.

One handler per format, all with the same two methods:
`quantize_linear(linear) -> nn.Module` (a frozen module with the same forward contract) and
`linear_bytes(module) -> int` (everything the format stores for that layer). `quantize_model`
walks the decoder blocks and swaps in the quantized layers; embeddings, norms and lm_head stay
in the compute dtype.

Formats: `nf4` (bitsandbytes, optionally with double quant) here; `nvfp4` and `mxfp4` in
`qerl_exp.quant.fp4` (our own packing; `docs/quant.md` has the layout). Every quantized layer is an
`nn.Linear` subclass whose `weight` is its packed data, so peft attaches LoRA to it with a plain
`LoraConfig` (nothing to register).
"""

from __future__ import annotations

import torch
from torch import nn

from qerl_exp.config import QuantConfig
from qerl_exp.quant import fp4
from qerl_exp.quant.fp4 import FP4Linear


class _NF4:
    """bitsandbytes NF4 (QLoRA): 16 normal-float levels, absmax per 64; optional double quant."""

    def __init__(self, double_quant: bool, compute_dtype: torch.dtype):
        self.double_quant = double_quant
        self.compute_dtype = compute_dtype

    def quantize_linear(self, linear: nn.Linear) -> nn.Module:
        import bitsandbytes as bnb

        layer = bnb.nn.Linear4bit(
            linear.in_features, linear.out_features, bias=linear.bias is not None,
            compute_dtype=self.compute_dtype, quant_type="nf4", compress_statistics=self.double_quant,
            device="meta",
        )
        layer.weight = bnb.nn.Params4bit(
            linear.weight.data.float().cpu(), requires_grad=False, quant_type="nf4",
            compress_statistics=self.double_quant,
        )
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data.to(self.compute_dtype), requires_grad=False)
        # Moving the Params4bit to a device is what quantizes it.
        layer = layer.to(linear.weight.device)
        # docs/quant.md: on AVX512-BF16 CPUs the first no-grad forward repacks the weight in
        # place, after which backward through the layer is wrong. Keep the portable packing.
        layer.support_avx512bf16_for_cpu = False
        return layer

    @staticmethod
    def linear_bytes(module: nn.Module) -> int:
        w = module.weight
        return _tensor_bytes(w.data) + _quant_state_bytes(w.quant_state) + _bias_bytes(module)


def _quant_state_bytes(qs) -> int:
    n = _tensor_bytes(qs.absmax) + _tensor_bytes(qs.code)
    if getattr(qs, "offset", None) is not None:
        n += _tensor_bytes(qs.offset)
    if getattr(qs, "state2", None) is not None:
        n += _quant_state_bytes(qs.state2)
    return n


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _bias_bytes(module: nn.Module) -> int:
    return _tensor_bytes(getattr(module, "bias", None))


def _handler(cfg: QuantConfig, compute_dtype: torch.dtype):
    if cfg.format == "nf4":
        return _NF4(cfg.double_quant, compute_dtype)
    if cfg.format in ("nvfp4", "mxfp4"):
        return fp4.Handler(cfg.format, compute_dtype)
    raise ValueError(f"quant.format={cfg.format!r} has no handler; valid: none, nf4, nvfp4, mxfp4")


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
    for _, parent, attr, linear in decoder_linears(model, cfg.targets):
        if type(linear) is nn.Linear:  # already quantized layers (a block done while loading) stay
            setattr(parent, attr, handler.quantize_linear(linear))
    return model


def base_weight(module: nn.Module, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The [out, in] matrix a frozen linear multiplies by, in `dtype`, for the learner's products:
    a dense layer's own weight (no copy when the dtype matches), a 4-bit one's decoded anew.

    Args:
        module: an `nn.Linear`, an `FP4Linear` or a bitsandbytes `Linear4bit`.
        dtype: the activations' dtype.
        out: a contiguous [out, in] tensor (a slice of a stacked group's weight) to write into.

    Returns:
        The weight (`out` itself when given).
    """
    import bitsandbytes as bnb

    if isinstance(module, FP4Linear):
        w = module.dequantize(dtype, out=out)
    elif isinstance(module, bnb.nn.Linear4bit):
        w = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).to(dtype)
    else:
        w = module.weight.to(dtype)
    if out is None or w.data_ptr() == out.data_ptr():
        return w if out is None else out
    return out.copy_(w)


def stacked_base_weight(modules: list[nn.Module], dtype: torch.dtype) -> torch.Tensor:
    """The [sum of out, in] matrix of frozen linears fed one input (a projection group), their
    `base_weight`s one after another by rows, in a new tensor (NVFP4 layers decoded in one launch)."""
    rows = [m.out_features for m in modules]
    out = torch.empty(sum(rows), modules[0].in_features, dtype=dtype, device=modules[0].weight.device)
    if all(isinstance(m, FP4Linear) for m in modules):
        return FP4Linear.dequantize_stacked(modules, out)
    for m, part in zip(modules, out.split(rows)):
        base_weight(m, dtype, out=part)
    return out


def dense_weight(module: nn.Module) -> torch.Tensor:
    """The weight of a linear, quantized or not, as a dense fp32 [out, in] matrix.

    Args:
        module: an `nn.Linear`, an `FP4Linear` or a bitsandbytes `Linear4bit` (their `weight` is
            packed data, not the matrix).

    Returns:
        A new fp32 tensor: exactly what the layer multiplies by (before casting to the activations'
        dtype).
    """
    w = base_weight(module, torch.float32).detach()
    return w.clone() if w.data_ptr() == module.weight.data_ptr() else w  # a dense fp32 layer's own weight


def memory_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes the model stores: `mem/weights_bytes` (every parameter and buffer, quantized layers
    counted with all their scales and state) and `mem/quantized_linear_bytes`."""
    import bitsandbytes as bnb

    quantized = 0
    counted: set[int] = set()
    for module in model.modules():
        nbytes = None
        if isinstance(module, bnb.nn.Linear4bit):
            nbytes = _NF4.linear_bytes(module)
        # Looked up on the class: peft's wrappers forward unknown attributes to their base layer.
        elif callable(getattr(type(module), "quantized_bytes", None)):
            nbytes = module.quantized_bytes()
        if nbytes is not None:
            quantized += nbytes
            counted.update(id(t) for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)))
    rest = 0
    seen: set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in counted or id(t) in seen:
            continue
        seen.add(id(t))
        rest += _tensor_bytes(t)
    return {"mem/weights_bytes": quantized + rest, "mem/quantized_linear_bytes": quantized}
