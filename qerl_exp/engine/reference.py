"""Torch twins of the engine's fused ops: what each Triton kernel computes, rounding where HF
rounds. They run anywhere (CPU, the prefill, machines without Triton) and the tests hold the
kernels to them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from qerl_exp.engine.layout import PackedWeight, weight_of


def rms_norm_ref(x: Tensor, gamma: Tensor, eps: float) -> Tensor:
    """HF Llama/Qwen2 RMSNorm, rounding exactly where HF rounds."""
    xf = x.float()
    hn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return gamma * hn


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF rotary embedding: x [..., d] with cos/sin broadcastable to it."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def linear_ref(x: Tensor, w: Tensor | PackedWeight, bias: Tensor | None, scratch: Tensor | None = None) -> Tensor:
    """x @ W^T + b in the activation dtype (cuBLAS on CUDA); 4-bit weights are dequantized first
    (NVFP4 on the GPU into `scratch` when given, see `weight_of`)."""
    return F.linear(x, weight_of(w, x.dtype, scratch), bias)
