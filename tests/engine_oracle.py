"""What the engine's kernels compute, in torch ops, rounding where HF and peft round: the oracle the
engine tests hold the kernels to."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from qerl_exp.quant.layout import weight_of


def rms_norm(x: Tensor, gamma: Tensor, eps: float) -> Tensor:
    """HF Llama/Qwen2 RMSNorm."""
    xf = x.float()
    hn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return gamma * hn


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF rotary embedding: x [..., d] with cos/sin broadcastable to it."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def linear(lin, x: Tensor) -> Tensor:
    """A `decode.LinearGroup` group as HF and peft compute it: base (+ bias) + lora_B(lora_A(x)) * scaling
    per projection, the LoRA term and its addition in the adapters' dtype (fp32 under a bf16 base);
    GLU: silu(gate) * up; else the projections side by side."""
    outs = []
    xa = x.to(lin.lora_a[0].dtype) if lin.lora_a is not None else None
    for s, (w, b) in enumerate(zip(lin.weights, lin.biases)):
        y = F.linear(x, weight_of(w, x.dtype), b)
        if lin.lora_a is not None:
            a = lin.lora_a[s]
            t = F.linear(xa, a)
            y = torch.addmm(y.reshape(-1, y.shape[-1]).to(a.dtype), t.reshape(-1, t.shape[-1]), lin.lora_b[s].t(),
                            alpha=lin.scale[s]).to(x.dtype).view(y.shape)
        outs.append(y)
    if lin.glu:
        return F.silu(outs[0]) * outs[1]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float) -> Tensor:
    """Decode attention by SDPA: q [B, hq, d]; k, v [B, hkv, S, d]; mask [B, 1, 1, S] -> [B, hq * d],
    the grouped-query heads folded into the query length."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    out = F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), k, v, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq * d)
