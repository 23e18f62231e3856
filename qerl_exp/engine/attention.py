"""Decode attention: one new token per sequence against its live KV-cache slots, in one Triton launch
a layer, the live range of a sequence-head split over several programs where a few sequences have
long contexts (`docs/engine.md`, "Kernel families").
"""

from __future__ import annotations

import torch
from torch import Tensor

from qerl_exp.engine.triton_util import _dot, dummy_tensor, pow2, sm_count, tl, triton


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, pad_ptr, slot_ptr, stride_kb, stride_kh, stride_ks, scaling, HQ,
    acc_ptr, ml_ptr, count_ptr,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS: tl.constexpr,
    MIN_BLOCKS: tl.constexpr,
):
    # One (sequence b, kv head h, split s) per program: its G query heads against a run of the
    # live cache slots pad[b]..slot, online softmax in fp32 over BLOCK_S slots a step. The live
    # blocks are cut into at most SPLITS runs of at least MIN_BLOCKS blocks (a few sequences at
    # long contexts are otherwise a few programs' serial loops); with more than one run, each
    # writes its (max, sum, unnormalised output) and the last run to finish combines them in
    # run order.
    ACT = q_ptr.dtype.element_ty
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    lo = tl.load(pad_ptr + b)
    hi = tl.load(slot_ptr)
    first = lo // BLOCK_S
    nblocks = hi // BLOCK_S - first + 1
    per = tl.cdiv(nblocks, tl.maximum(1, tl.minimum(SPLITS, nblocks // MIN_BLOCKS)))
    runs = tl.cdiv(nblocks, per)  # each of at least MIN_BLOCKS blocks but for a lone one
    if s < runs:
        gq = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        rows = (b * HQ + h * G + gq)[:, None] * D + d[None, :]
        q = tl.load(q_ptr + rows, mask=gq[:, None] < G, other=0.0)
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        base = b * stride_kb + h * stride_kh
        j0 = first + s * per
        for j in range(j0, tl.minimum(j0 + per, first + nblocks)):
            sl = j * BLOCK_S + tl.arange(0, BLOCK_S)
            kt = tl.load(k_ptr + base + sl[None, :] * stride_ks + d[:, None])
            qk = _dot(q, kt, None) * scaling
            qk = tl.where(((sl >= lo) & (sl <= hi))[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + base + sl[:, None] * stride_ks + d[None, :])
            acc = acc * alpha[:, None] + _dot(p.to(ACT), v, None)
            m_i = m_new
        last = tl.full((), 1, tl.int1)  # this program writes the output
        if SPLITS > 1:  # compiled out where one program takes a sequence-head (no second accumulator)
            if runs > 1:
                bh = b * tl.num_programs(1) + h
                part = (bh * SPLITS + s) * G_PAD
                tl.store(acc_ptr + (part + gq)[:, None] * D + d[None, :], acc)
                tl.store(ml_ptr + 2 * part + gq, m_i)
                tl.store(ml_ptr + 2 * part + G_PAD + gq, l_i)
                tl.debug_barrier()  # every thread's partials written before the release below
                last = tl.atomic_add(count_ptr + bh, 1, sem="acq_rel") == runs - 1
                if last:
                    acc, l_i = _combine_runs(acc_ptr, ml_ptr, bh, runs, gq, d, SPLITS, G_PAD, D)
                    tl.store(count_ptr + bh, 0)  # ready for the next launch
        if last:
            tl.store(out_ptr + rows, (acc / l_i[:, None]).to(ACT), mask=gq[:, None] < G)


@triton.jit
def _combine_runs(acc_ptr, ml_ptr, bh, runs, gq, d, SPLITS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr):
    # (unnormalised output, sum) of sequence-head bh's runs, combined in run order; read .cg:
    # other SMs wrote them, past this SM's L1
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    for r in range(0, runs):
        at = (bh * SPLITS + r) * G_PAD
        m_r = tl.load(ml_ptr + 2 * at + gq, cache_modifier=".cg")
        l_r = tl.load(ml_ptr + 2 * at + G_PAD + gq, cache_modifier=".cg")
        acc_r = tl.load(acc_ptr + (at + gq)[:, None] * D + d[None, :], cache_modifier=".cg")
        m_new = tl.maximum(m_i, m_r)
        alpha, beta = tl.exp(m_i - m_new), tl.exp(m_r - m_new)
        l_i = l_i * alpha + l_r * beta
        acc = acc * alpha[:, None] + acc_r * beta[:, None]
        m_i = m_new
    return acc, l_i

ATTENTION_MIN_BLOCKS = 4  # live 64-slot blocks a split of decode attention takes at least


def attention_splits(b: int, hkv: int, device: torch.device) -> int:
    """Programs a (sequence, kv head) of `decode_attention`: as many as make about two waves of the
    SMs (at most 16), so that a batch of a few sequences at long contexts is not a few programs'
    serial loops; from 2 * SMs sequence-heads on (64 sequences of 4 kv heads fill a 132-SM GPU), one."""
    return max(1, min(16, 2 * sm_count(device) // (b * hkv)))


def attention_workspace(b: int, hq: int, hkv: int, d: int, device: torch.device,
                        splits: int | None = None) -> tuple[Tensor, ...] | None:
    """The buffers `decode_attention` combines split runs through, for batches of `b` sequences:
    `(acc [b, hkv, splits, G_PAD, d], max and sum [b, hkv, splits, 2, G_PAD], count int32 [b, hkv])`;
    None where it takes one program a sequence-head. `splits`: `attention_splits` unless given."""
    splits = splits or attention_splits(b, hkv, device)
    if splits == 1:
        return None
    g_pad = pow2(hq // hkv)
    f32 = dict(dtype=torch.float32, device=device)
    return (torch.zeros(b, hkv, splits, g_pad, d, **f32), torch.zeros(b, hkv, splits, 2, g_pad, **f32),
            torch.zeros(b, hkv, dtype=torch.int32, device=device))


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, pad: Tensor, slot: Tensor, scaling: float,
                     out: Tensor, work: tuple[Tensor, ...] | None = None) -> Tensor:
    """Triton: attention of one new token per sequence over its live cache slots (pad[b]..slot).

    Args:
        q: [B, hq, d]. k_cache / v_cache: [B_max, hkv, S, d], S a multiple of 64.
        pad: int [B] first live slot per sequence. slot: int [1] this token's slot (the last live).
        out: [B, hq * d], returned.
        work: `attention_workspace(B, ...)`: the live slots of a sequence-head split over up to its
            `splits` programs (runs of at least `ATTENTION_MIN_BLOCKS` blocks); None: one program.
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    splits = 1 if work is None else work[0].shape[2]
    acc, ml, count = work if work is not None else (dummy_tensor(q.device, torch.float32),) * 2 + (
        dummy_tensor(q.device, torch.int32),)
    _decode_attention_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, out, pad, slot, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scaling, hq,
        acc, ml, count, G=g, G_PAD=pow2(g), D=d, BLOCK_S=64, SPLITS=splits, MIN_BLOCKS=ATTENTION_MIN_BLOCKS,
        num_warps=4,
    )
    return out
