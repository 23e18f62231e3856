"""Rotary embedding and the KV-cache write in one launch (`rope_cache`): q and k of each token
rotated (after Qwen3's per-head RMSNorm where the model has one), k and v written to their cache
slots; the decode step and the prefill both use it.
"""

from __future__ import annotations

from torch import Tensor

from qerl_exp.engine.triton_util import tl, triton


@triton.jit
def _rope_cache_kernel(
    qkv_ptr, stride_qm, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr,
    kc_ptr, vc_ptr, stride_cb, stride_ch, stride_cs, qn_ptr, kn_ptr, eps,
    HQ, HKV, P, D: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr,
):
    # One (token row, head) per program, P rows a sequence (decode: 1; the prefill: the prompt
    # length, row i of sequence b at slot `slot` + i); heads [0, HQ) are queries (rotated,
    # written to q [B, HQ, P, D]), [HQ, HQ + HKV) keys (rotated, into the cache), the rest
    # values (copied). QK_NORM (Qwen3): queries and keys are first RMS-normalised over the
    # head's D values and scaled by qn / kn [D].
    ACT = qkv_ptr.dtype.element_ty
    row = tl.program_id(0)
    h = tl.program_id(1)
    b = row // P
    i = row - b * P
    d = tl.arange(0, HALF)
    src = qkv_ptr + row * stride_qm + h * D
    x1 = tl.load(src + d)
    x2 = tl.load(src + HALF + d)
    slot = tl.load(slot_ptr) + i
    if h < HQ + HKV:
        pos = tl.load(pos_ptr + row)
        c1 = tl.load(cos_ptr + pos * D + d).to(tl.float32)
        c2 = tl.load(cos_ptr + pos * D + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + pos * D + d).to(tl.float32)
        s2 = tl.load(sin_ptr + pos * D + HALF + d).to(tl.float32)
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        if QK_NORM:  # HF's RMSNorm: in fp32, rounded to the activations' dtype, then times the scale
            rstd = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / D + eps)
            w_ptr = qn_ptr if h < HQ else kn_ptr
            w1 = tl.load(w_ptr + d).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
            f1 = (w1 * (f1 * rstd).to(ACT).to(tl.float32)).to(ACT).to(tl.float32)
            f2 = (w2 * (f2 * rstd).to(ACT).to(tl.float32)).to(ACT).to(tl.float32)
        # HF: q * cos + rotate_half(q) * sin, each product rounded to the model dtype
        y1 = ((f1 * c1).to(ACT).to(tl.float32) + (-f2 * s1).to(ACT).to(tl.float32)).to(ACT)
        y2 = ((f2 * c2).to(ACT).to(tl.float32) + (f1 * s2).to(ACT).to(tl.float32)).to(ACT)
        if h < HQ:
            dst = q_ptr + ((b * HQ + h) * P + i) * D
        else:
            dst = kc_ptr + b * stride_cb + (h - HQ) * stride_ch + slot * stride_cs
        tl.store(dst + d, y1)
        tl.store(dst + HALF + d, y2)
    else:
        dst = vc_ptr + b * stride_cb + (h - HQ - HKV) * stride_ch + slot * stride_cs
        tl.store(dst + d, x1)
        tl.store(dst + HALF + d, x2)


def rope_cache(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, slot: Tensor, q_out: Tensor,
               k_cache: Tensor, v_cache: Tensor, hq: int, hkv: int, d: int, p: int = 1,
               qk_norm: tuple[Tensor, Tensor, float] | None = None) -> None:
    """Triton: rotate q and k of p tokens per sequence; write k, v into the cache from `slot` on.

    Args:
        qkv: [B * p, (hq + 2 hkv) * d] fused projection output, each sequence's p rows together.
            cos/sin: [S_max, d] tables.
        pos: int [B * p] rotary position per row. slot: int [1] cache index of each sequence's first
            row (decode: its one token; the prefill: 0, with p its prompt length).
        q_out: [B, hq, p, d]. k_cache / v_cache: [B_max, hkv, S_max, d] (batch rows 0..B-1 used).
        qk_norm: (q scale [d], k scale [d], eps): each head's q and k RMS-normalised before the
            rotation (Qwen3); None: none.
    """
    rows = qkv.shape[0]
    qn, kn, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    _rope_cache_kernel[(rows, hq + 2 * hkv)](
        qkv, qkv.stride(0), cos, sin, pos, slot, q_out,
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), qn, kn, eps,
        hq, hkv, p, D=d, HALF=d // 2, QK_NORM=qk_norm is not None, num_warps=1,
    )
