"""The padding-free learner's elementwise ops on CUDA as hand-fused Triton kernels, forward and backward:
the residual add with RMSNorm, RoPE, SwiGLU (`qerl_exp.decoders.padding_free` calls them; elsewhere it runs its
torch definitions, which these equal up to the rounding of intermediates).

Each op is one autograd node of one forward and one backward launch. At the learner's small
micro-batches the step is bound by the host issuing launches: a node here costs the host one
launch where a `torch.compile`d op costs its guards and AOT-autograd wrappers (docs/learner.md);
and each kernel streams its rows once, SwiGLU's backward included. Rounding follows HF's modules
in bf16/fp16: each torch op's result is rounded to the activation dtype where the op would round
it. Norm weights are frozen (only LoRA trains): no gradient for them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_fwd(x_ptr, d_ptr, s_ptr, y_ptr, w_ptr, rstd_ptr, H, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    # one row: s = x + delta (stored), y = w * (s * rsqrt(mean(s^2) + eps)) with HF's roundings
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(d_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(s_ptr + row * H + cols, x, mask=ok)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / H + eps)
    n = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * H + cols, (w * n).to(x.dtype), mask=ok)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _norm_bwd(gy_ptr, gs_ptr, s_ptr, w_ptr, rstd_ptr, gx_ptr, H, HAS_GS: tl.constexpr, BLOCK: tl.constexpr):
    # d(norm input) = rstd (g - n mean(g n)), g = gy * w, n = s * rstd; plus the residual's own gradient
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    gy = tl.load(gy_ptr + row * H + cols, mask=ok, other=0.0)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    g = (gy.to(tl.float32) * w.to(tl.float32)).to(gy.dtype).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    n = tl.load(s_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32) * rstd
    gx = (rstd * (g - n * (tl.sum(g * n, axis=0) / H))).to(gy.dtype)
    if HAS_GS:
        gx = (gx.to(tl.float32) + tl.load(gs_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)).to(gy.dtype)
    tl.store(gx_ptr + row * H + cols, gx, mask=ok)


def _rows(x: torch.Tensor) -> tuple[int, int, int]:
    """(rows, width, the block of one row's program)."""
    h = x.shape[-1]
    return x.numel() // h, h, triton.next_power_of_2(h)


class _RMSNorm(torch.autograd.Function):
    """`y` (`delta` None) or `(x + delta, y)`, y = RMSNorm of the sum."""

    @staticmethod
    def forward(ctx, x, delta, weight, eps):
        x = x.contiguous()
        n, h, block = _rows(x)
        s = x if delta is None else torch.empty_like(x)
        y, rstd = torch.empty_like(x), torch.empty(n, dtype=torch.float32, device=x.device)
        _norm_fwd[(n,)](x, x if delta is None else delta.contiguous(), s, y, weight, rstd, h, eps,
                        HAS_DELTA=delta is not None, BLOCK=block, num_warps=8)
        ctx.save_for_backward(s, weight, rstd)
        ctx.add = delta is not None
        return (s, y) if ctx.add else y

    @staticmethod
    def backward(ctx, *grads):
        s, weight, rstd = ctx.saved_tensors
        gs, gy = grads if ctx.add else (None, grads[0])
        n, h, block = _rows(s)
        gx, gy = torch.empty_like(s), gy.contiguous()
        _norm_bwd[(n,)](gy, gy if gs is None else gs.contiguous(), s, weight, rstd, gx, h, HAS_GS=gs is not None,
                        BLOCK=block, num_warps=8)
        return gx, (gx if ctx.add else None), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`blocks.rms_norm` (the declared architectures' RMSNorm) in one launch each way."""
    return _RMSNorm.apply(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """`padding_free._add_rms_norm`: `(x + delta, RMSNorm(x + delta))` in one launch each way."""
    return _RMSNorm.apply(x, delta, weight, eps)


@triton.jit
def _swiglu_fwd(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
    # out = silu(gate) * up over [gate | up] rows, each product rounded as torch rounds it
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    act = (gf * tl.sigmoid(gf)).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * I + cols, (act * u.to(tl.float32)).to(g.dtype), mask=ok)


@triton.jit
def _swiglu_bwd(gu_ptr, go_ptr, dgu_ptr, I, BLOCK: tl.constexpr):
    # d up = go * silu(gate); d gate = (go * up) * silu'(gate)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
    go = tl.load(go_ptr + row * I + cols, mask=ok, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    sig = tl.sigmoid(gf)
    act = (gf * sig).to(g.dtype).to(tl.float32)
    g_act = (go * u).to(g.dtype).to(tl.float32)
    tl.store(dgu_ptr + row * 2 * I + cols, (g_act * sig * (1.0 + gf * (1.0 - sig))).to(g.dtype), mask=ok)
    tl.store(dgu_ptr + row * 2 * I + I + cols, (go * act).to(g.dtype), mask=ok)


_SWIGLU_BLOCK = 2048


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        gate_up = gate_up.contiguous()
        n, i = gate_up.numel() // gate_up.shape[-1], gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], i)
        _swiglu_fwd[(n, triton.cdiv(i, _SWIGLU_BLOCK))](gate_up, out, i, BLOCK=_SWIGLU_BLOCK, num_warps=8)
        ctx.save_for_backward(gate_up)
        return out

    @staticmethod
    def backward(ctx, go):
        (gate_up,) = ctx.saved_tensors
        n, i = gate_up.numel() // gate_up.shape[-1], gate_up.shape[-1] // 2
        dgu = torch.empty_like(gate_up)
        _swiglu_bwd[(n, triton.cdiv(i, _SWIGLU_BLOCK))](gate_up, go.contiguous(), dgu, i, BLOCK=_SWIGLU_BLOCK,
                                                       num_warps=8)
        return dgu


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """`padding_free._swiglu`: `silu(gate) * up` of `[..., gate | up]` in one launch each way."""
    return _SwiGLU.apply(gate_up)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_stride, k_stride, cos_ptr, sin_ptr, qo_ptr, ko_ptr, HQ, HK,
                 D: tl.constexpr, HP: tl.constexpr, BACKWARD: tl.constexpr):
    # one token's query and key heads: forward y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2 (HF's
    # rotate_half), backward its transpose: x1 = g1 c1 + g2 s2, x2 = g2 c2 - g1 s1
    row = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = D // 2
    heads = tl.arange(0, HP)[:, None]
    j = tl.arange(0, half)[None, :]
    is_q = heads < HQ
    is_k = (heads >= HQ) & (heads < HQ + HK)
    q_at = q_ptr + row * q_stride + heads * D + j
    k_at = k_ptr + row * k_stride + (heads - HQ) * D + j
    x1 = tl.where(is_q, tl.load(q_at, mask=is_q, other=0.0), tl.load(k_at, mask=is_k, other=0.0))
    x2 = tl.where(is_q, tl.load(q_at + half, mask=is_q, other=0.0), tl.load(k_at + half, mask=is_k, other=0.0))
    c1 = tl.load(cos_ptr + row * D + j).to(tl.float32)
    c2 = tl.load(cos_ptr + row * D + half + j).to(tl.float32)
    s1 = tl.load(sin_ptr + row * D + j).to(tl.float32)
    s2 = tl.load(sin_ptr + row * D + half + j).to(tl.float32)
    dt = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    if BACKWARD:
        y1 = (a1 * c1).to(dt).to(tl.float32) + (a2 * s2).to(dt).to(tl.float32)
        y2 = (a2 * c2).to(dt).to(tl.float32) - (a1 * s1).to(dt).to(tl.float32)
    else:
        y1 = (a1 * c1).to(dt).to(tl.float32) - (a2 * s1).to(dt).to(tl.float32)
        y2 = (a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)
    qo = qo_ptr + row * HQ * D + heads * D + j
    ko = ko_ptr + row * HK * D + (heads - HQ) * D + j
    tl.store(qo, y1.to(dt), mask=is_q)
    tl.store(qo + half, y2.to(dt), mask=is_q)
    tl.store(ko, y1.to(dt), mask=is_k)
    tl.store(ko + half, y2.to(dt), mask=is_k)


def _rope_launch(q, k, cos, sin, backward: bool):
    n, hq, d = q.shape
    hk = k.shape[1]
    if q.stride(2) != 1 or q.stride(1) != d or k.stride(2) != 1 or k.stride(1) != d:
        q, k = q.contiguous(), k.contiguous()
    qo, ko = q.new_empty(n, hq, d), k.new_empty(n, hk, d)
    _rope_kernel[(n,)](q, k, q.stride(0), k.stride(0), cos, sin, qo, ko, hq, hk, D=d,
                       HP=triton.next_power_of_2(hq + hk), BACKWARD=backward, num_warps=4)
    return qo, ko


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rope_launch(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        dq, dk = _rope_launch(gq, gk, cos, sin, backward=True)
        return dq, dk, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`padding_free._rope`: rotary embedding of `[N, H, D]` queries and keys (strided views of one
    projection's output are read in place) in one launch each way; cos, sin `[N, D]`."""
    return _Rope.apply(q, k, cos, sin)
