"""RMSNorm and the LoRA shrink of the segments that read it, in one launch: `h = RMSNorm(x) * gamma`
and `t += h @ A_s^T` per segment (`norm_shrink`); the device functions that let a linear's own
kernel normalise on load (`_rstd`, `_x_tile`); the split-K kernels' norm and shrink arguments
(`norm_shrink_args`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qerl_exp.engine.triton_util import _dot, _dot_as_peft, _f16_div16, dummy_tensor, pow2, tl, tl_dtype, triton


@triton.jit
def _norm_shrink_kernel(
    x_ptr, stride_xm, g_ptr, h_ptr, stride_hm, a_tab_ptr, t_ptr, stride_tm, ss_ptr, stride_ss,
    M, K, r, eps, KCHUNK, T,
    NORM: tl.constexpr, LORA: tl.constexpr, NSEG: tl.constexpr, R: tl.constexpr, RT: tl.constexpr,
    LDT: tl.constexpr, T_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    H16: tl.constexpr, SS_HERE: tl.constexpr, EXACT: tl.constexpr,
):
    # h = RMSNorm(x) * g (HF rounding), written to h, with the rows' sums of squares given as
    # T partial sums ss[:T, m] (written by the residual epilogue that produced x, so no program
    # has to read whole rows; SS_HERE: summed here over whole rows instead, the prefill's
    # case); t[:, s*R + j] += h @ A_s[j]^T over this program's K chunk (split-K with fp32
    # atomics; t is zeroed once per decode step), in x's dtype, or EXACT: in the adapters'
    # (peft's rounding, as the prefill keeps it). H16: h holds h / 16 in fp16 instead (the
    # wgmma kernel's operand), also without the norm (then h = x / 16).
    ACT = x_ptr.dtype.element_ty
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    if NORM:
        if SS_HERE:
            sq = tl.zeros((BLOCK_M,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                xf = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                             mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
                sq += tl.sum(xf * xf, 1)
            rstd = tl.rsqrt(sq / K + eps)
        else:
            rstd = _rstd(ss_ptr, stride_ss, T, offs_m, m_ok, K, eps, T_PAD)
    jj = tl.arange(0, RT)
    seg = jj // R
    j_ok = (seg < NSEG) & ((jj % R) < r)
    a_row = tl.multiple_of(tl.load(a_tab_ptr + seg, mask=seg < NSEG, other=0).to(tl.pointer_type(LDT)), 16)
    a_row = a_row + (jj % R) * K
    acc = tl.zeros((BLOCK_M, RT), tl.float32)
    for k0 in range(pid_k * KCHUNK, pid_k * KCHUNK + KCHUNK, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            hn = (x.to(tl.float32) * rstd[:, None]).to(ACT)
            gam = tl.load(g_ptr + offs_k, mask=k_ok, other=0.0)
            x = (gam[None, :].to(tl.float32) * hn.to(tl.float32)).to(ACT)
        if H16:
            tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_k[None, :], _f16_div16(x),
                     mask=m_ok[:, None] & k_ok[None, :])
        elif NORM:
            tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_k[None, :], x,
                     mask=m_ok[:, None] & k_ok[None, :])
        if LORA:
            a = tl.load(a_row[None, :] + offs_k[:, None], mask=j_ok[None, :] & k_ok[:, None], other=0.0)
            if EXACT:
                acc = _dot_as_peft(x, a, acc)
            else:
                acc = _dot(x, a.to(ACT), acc)
    if LORA:
        tl.atomic_add(t_ptr + offs_m[:, None] * stride_tm + jj[None, :], acc,
                      mask=m_ok[:, None] & j_ok[None, :])


@triton.jit
def _rstd(ss_ptr, stride_ss, T, offs_m, m_ok, K, eps, T_PAD: tl.constexpr):
    # 1 / RMS of rows offs_m from T partial sums of squares ss[:T, m] (written by the residual
    # epilogue that produced the rows, so no program has to read whole rows)
    tt = tl.arange(0, T_PAD)
    ssp = tl.load(ss_ptr + tt[:, None] * stride_ss + offs_m[None, :], mask=(tt[:, None] < T) & m_ok[None, :],
                  other=0.0)
    return tl.rsqrt(tl.sum(ssp, 0) / K + eps)


@triton.jit
def _x_tile(x_ptr, stride_xm, offs_m, m_ok, offs_k, g_ptr, rstd, NORM: tl.constexpr):
    # activations [BM, BK] in the model dtype; NORM: RMSNorm(x) * gamma, rounded where HF rounds
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None], other=0.0)
    if NORM:
        ACT = x_ptr.dtype.element_ty
        hn = (x.to(tl.float32) * rstd[:, None]).to(ACT)
        x = (tl.load(g_ptr + offs_k)[None, :].to(tl.float32) * hn.to(tl.float32)).to(ACT)
    return x


def norm_shrink(x: Tensor, gamma: Tensor | None, eps: float, h_out: Tensor | None,
                a_tab: Tensor | None, nseg: int, r: int, t_out: Tensor | None,
                lora_dtype: torch.dtype | None = None, ss: Tensor | None = None, h16: bool = False,
                exact: bool = False) -> None:
    """Triton: h_out = RMSNorm(x) * gamma (if gamma given) and t_out += h @ A_s^T per segment.

    Args:
        x: [M, K] activations. gamma: [K] norm scale or None (no norm: the shrink reads x).
        h_out: [M, K] output of the norm (None when gamma is None and not h16).
        h16: h_out is fp16 and gets h / 16 (x / 16 without gamma): `nvfp4_wgmma`'s activations.
        a_tab: int64 [nseg] addresses of the LoRA A matrices ([r, K] each), or None (no LoRA).
        lora_dtype: dtype of those matrices (peft keeps adapters in fp32 under a bf16 base).
        exact: the dot runs in lora_dtype, as peft's (the prefill); else in x's dtype (decode).
        t_out: fp32 [M, >= nseg * R] accumulator, R = padded rank; must be zeroed by the caller.
        ss: fp32 [T, >= M]: partial sums of squares of x's rows (their sum over T is the row's
            sum), as `linear.fused_linear(ss_out=...)` writes them; None: each program sums its rows.
    """
    m, k = x.shape
    if a_tab is None:  # norm only
        nseg, r = 1, 0
    R = pow2(r)
    RT = pow2(nseg * R)
    # Up to 16 rows ~32 programs (more were no faster, and add atomics); from 17 rows 16-row blocks of
    # 64 inputs, ~128 programs, where 64-row blocks of 128 left most SMs idle (docs/engine.md). K
    # slices need not divide K (the last is masked): dividing it left 7B down's 148 chunks 4 slices
    wide = m > 16
    block_k = next((b for b in ((64,) if wide else (128, 64)) if k % b == 0), 32)
    # the prefill's thousands of rows: 64-row blocks, each program reading the A slices for 4x more
    block_m = 64 if m >= 2048 else 16
    m_blocks = triton.cdiv(m, block_m)
    chunks = triton.cdiv(k, block_k)
    per = triton.cdiv(chunks, max(1, min(chunks, (128 if wide else 32) // m_blocks)))
    split = triton.cdiv(chunks, per)
    dummy = dummy_tensor(x.device, x.dtype)
    f32 = dummy_tensor(x.device, torch.float32)
    _norm_shrink_kernel[(split, m_blocks)](
        x, x.stride(0), gamma if gamma is not None else dummy,
        h_out if h_out is not None else dummy, h_out.stride(0) if h_out is not None else 0,
        a_tab if a_tab is not None else dummy_tensor(x.device, torch.int64),
        t_out if t_out is not None else f32, t_out.stride(0) if t_out is not None else 0,
        ss if ss is not None else f32, ss.stride(0) if ss is not None else 0,
        m, k, r, eps, per * block_k, ss.shape[0] if ss is not None else 1,
        NORM=gamma is not None, LORA=a_tab is not None, NSEG=nseg, R=R, RT=RT,
        LDT=tl_dtype(lora_dtype or x.dtype), T_PAD=pow2(ss.shape[0] if ss is not None else 1, 1),
        BLOCK_M=block_m, BLOCK_K=block_k, H16=h16, SS_HERE=gamma is not None and ss is None, EXACT=exact,
        num_warps=4,
    )


def norm_shrink_args(x: Tensor, norm: tuple | None, shrink: Tensor | None, t: Tensor | None) -> tuple:
    """The split-K kernels' norm and shrink arguments (g, ss, stride_ss, T, eps, a_tab, t,
    stride_tm), dummies where unused, and T_PAD."""
    gamma, eps, ss = norm if norm is not None else (None, 0.0, None)
    f32 = dummy_tensor(x.device, torch.float32)
    args = (gamma if gamma is not None else dummy_tensor(x.device, x.dtype), ss if ss is not None else f32,
            ss.stride(0) if ss is not None else 0, ss.shape[0] if ss is not None else 1, eps,
            shrink if shrink is not None else dummy_tensor(x.device, torch.int64), t if t is not None else f32,
            t.stride(0) if t is not None else 0)
    return args, pow2(ss.shape[0] if ss is not None else 1, 1)
