"""NF4 (bitsandbytes NormalFloat4, the QLoRA baseline): 16 normal-float levels, an absmax scale per
64 weights; with double quant the absmax scales are quantized again to 8 bits in blocks of 256.

bitsandbytes stores and multiplies the weights (`Linear4bit`); `NF4Linear` is that layer with what
the harness's other readers need of a weight format: the dense weight the learner multiplies by
(`dequantize`), the rollout engine's kernel layout (`runtime_weight`, a re-laid-out copy) and the
bytes it stores (`quantized_bytes`). peft wraps it as any `Linear4bit`. This module imports
bitsandbytes (which prints notices at import): `qerl_exp.quant` loads it only when NF4 is asked for.
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
from torch import nn

from qerl_exp.quant.layout import KernelWeight, relayout_nf4


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _state_bytes(qs) -> int:
    n = _nbytes(qs.absmax) + _nbytes(qs.code)
    if getattr(qs, "offset", None) is not None:
        n += _nbytes(qs.offset)
    if getattr(qs, "state2", None) is not None:
        n += _state_bytes(qs.state2)
    return n


class NF4Linear(bnb.nn.Linear4bit):
    """A frozen bitsandbytes NF4 layer (`Linear4bit`, quant_type nf4) holding `linear`'s weight.

    Args:
        linear: the layer to quantize; it is not modified.
        double_quant: quantize the absmax scales again (QLoRA's double quant).
        compute_dtype: the dtype bitsandbytes multiplies in (the activations').
    """

    def __init__(self, linear: nn.Linear, double_quant: bool, compute_dtype: torch.dtype):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         compute_dtype=compute_dtype, quant_type="nf4", compress_statistics=double_quant,
                         device="meta")
        self.weight = bnb.nn.Params4bit(linear.weight.data.float().cpu(), requires_grad=False, quant_type="nf4",
                                        compress_statistics=double_quant)
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.data.to(compute_dtype), requires_grad=False)
        # On AVX512-BF16 CPUs the first no-grad forward repacks the weight in place, after which
        # backward through the layer is wrong (docs/quant.md): keep the portable packing.
        self.support_avx512bf16_for_cpu = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, double_quant: bool, compute_dtype: torch.dtype) -> NF4Linear:
        """The quantized layer on `linear`'s device (moving a `Params4bit` there is what quantizes it)."""
        return cls(linear, double_quant, compute_dtype).to(linear.weight.device)

    def _absmax(self) -> torch.Tensor:
        qs = self.weight.quant_state
        if qs.nested:
            return bnb.functional.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
        return qs.absmax

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """The dense weight `[out, in]` the layer multiplies by, in `dtype` (`out` is not written:
        the caller copies)."""
        return bnb.functional.dequantize_4bit(self.weight.data, self.weight.quant_state).to(dtype)

    @staticmethod
    def dequantize_stacked(layers: list[NF4Linear], out: torch.Tensor) -> torch.Tensor:
        """The layers' dense weights decoded into `out` `[sum of out, in]`, one after another by rows."""
        for layer, part in zip(layers, out.split([m.out_features for m in layers])):
            part.copy_(layer.dequantize(out.dtype))
        return out

    def runtime_weight(self) -> KernelWeight:
        """The weight in the rollout engine's NF4 layout: a copy, re-laid out from bitsandbytes' own
        dequantization (independent of its byte order and CPU repacking); the caller holds it."""
        qs = self.weight.quant_state
        if qs.blocksize != 64:
            raise NotImplementedError(f"NF4 blocksize {qs.blocksize}: the engine's kernels read blocks of 64")
        deq = bnb.functional.dequantize_4bit(self.weight.data, qs)
        return relayout_nf4(deq, self._absmax().float(), qs.code, qs.blocksize)

    def quantized_bytes(self) -> int:
        """Bytes the layer stores: codes, absmax (and their double-quant state), the levels, the bias."""
        return _nbytes(self.weight.data) + _state_bytes(self.weight.quant_state) + _nbytes(self.bias)


class Handler:
    """The quant handler of `nf4` (the same methods as every format's handler).

    Args:
        format: `nf4`.
        double_quant: QLoRA's double quant of the absmax scales.
        compute_dtype: the activations' dtype.
    """

    def __init__(self, format: str, compute_dtype: torch.dtype, double_quant: bool = False):
        self.double_quant, self.compute_dtype = double_quant, compute_dtype

    def quantize_linear(self, linear: nn.Linear) -> NF4Linear:
        return NF4Linear.from_linear(linear, self.double_quant, self.compute_dtype)
