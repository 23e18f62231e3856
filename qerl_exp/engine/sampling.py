"""One token per row from the logits: the torch definition (`sample`) and the Triton version the
decode step runs (`fused_sample`).

Both draw from softmax(logits / T) cut by HF's filters in `generate`'s order (top-k, top-p,
min-p; `Filters` says which a decode step applies) and return the drawn token's log-prob under
that cut, renormalised distribution (the one it was drawn from; `rollout` says why) and the entropy
of the uncut softmax. `fused_sample` takes top-k and min-p as one threshold per row on the tempered
logits (`keep_threshold`: the k-th largest, and the largest plus log(min_p)); top-p needs a sort,
so a step with top-p runs `sample`.

`sample` makes about fifteen passes over the [B, V] logits (log-softmax, exp, the entropy sum, the
noise, its log, argmax, gather). At 7B's vocabulary of 152064 and 64 rows they took 0.32 ms of a
4.6 ms NVFP4 decode step on the H200 (bench/profile/decode_step.py), growing with the batch: time the
4-bit and the bf16 engine both spend, so it dilutes what 4-bit weights save. `fused_sample` (45 us
there) reads the logits once (`_partial_kernel`: online max, sum of exp and entropy term, and the Gumbel-max
argmax over a slice of each row) and combines the slices (`_finish_kernel`). Its noise is
counter-based (Philox), keyed by (seed, step, row, token index), so a CUDA graph replays it
without host work and a draw does not depend on how the row is split.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from qerl_exp.engine.triton_util import pow2, sm_count, tl, triton

Q = 512  # logits a sub-block (4 warps: 4 a thread); one Philox call gives four sub-blocks' noise


@triton.jit
def _update(z, idx, u, thr, m, s, sk, t, best, bidx, GREEDY: tl.constexpr, FILTER: tl.constexpr):
    # fold logits z / T into each lane's running max m, sum of exp s = sum e^(z - m), the same sum
    # over the kept logits (z >= thr) sk, and entropy term t = sum e^(z - m) (z - m) (rescaled when m
    # grows), and its Gumbel-max argmax over the kept logits (best, bidx)
    m_new = tl.maximum(m, z)
    a = tl.exp(m - m_new)
    e = tl.exp(z - m_new)
    t = a * (t + (m - m_new) * s) + tl.where(e > 0, e * (z - m_new), 0.0)
    s = a * s + e
    key = z
    if not GREEDY:
        key = z - tl.log(-tl.log(u))  # + Gumbel noise: argmax is a draw from softmax(z)
    if FILTER:
        keep = z >= thr
        sk = a * sk + tl.where(keep, e, 0.0)
        key = tl.where(keep, key, float("-inf"))
    else:
        sk = s
    better = key > best
    return m_new, s, sk, t, tl.where(better, key, best), tl.where(better, idx, bidx)


@triton.jit
def _combine(m, s, sk, t, best, idx):
    # running values side by side (lanes, or a row's slices) -> one: the max mm, the sums of exp and
    # the entropy term rescaled to it, the best key and its index (the first of equal keys)
    mm = tl.max(m, 0)
    a = tl.exp(m - mm)
    bb = tl.max(best, 0)
    tok = tl.min(tl.where(best == bb, idx, 2147483647), 0)
    return mm, tl.sum(a * s, 0), tl.sum(a * sk, 0), tl.sum(a * (t + (m - mm) * s), 0), bb, tok


@triton.jit
def _partial_kernel(x_ptr, stride_x, V, temp_ptr, seed_ptr, step_ptr, thr_ptr, part_ptr, ipart_ptr, CHUNK,
                    GREEDY: tl.constexpr, FILTER: tl.constexpr, Q: tl.constexpr):
    # program (row, slice): logits [slice * CHUNK, + CHUNK) of the row -> (max, sum, entropy term,
    # best key, kept sum) and the best key's index, in part[row, slice, :5] and ipart[row, slice]
    row = tl.program_id(0)
    sl = tl.program_id(1)
    x_ptr += row.to(tl.int64) * stride_x
    inv_t = 1.0 / tl.load(temp_ptr)
    thr = 0.0
    if FILTER:
        thr = tl.load(thr_ptr + row)
    lo = sl * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    seed = tl.load(seed_ptr) + tl.load(step_ptr) * 65536 + row  # one key per (call, step, row)
    lane = tl.arange(0, Q)
    m = tl.full([Q], -1e30, tl.float32)  # finite before any finite logit: exp(m - m_new) is never NaN
    s = tl.zeros([Q], tl.float32)
    sk = tl.zeros([Q], tl.float32)
    t = tl.zeros([Q], tl.float32)
    best = tl.full([Q], float("-inf"), tl.float32)
    bidx = tl.zeros([Q], tl.int32) + lo
    for base in range(lo, hi, 4 * Q):
        i0, i1, i2, i3 = base + lane, base + Q + lane, base + 2 * Q + lane, base + 3 * Q + lane
        # the four loads first, so their latencies overlap
        z0 = tl.load(x_ptr + i0, mask=i0 < hi, other=float("-inf")).to(tl.float32) * inv_t
        z1 = tl.load(x_ptr + i1, mask=i1 < hi, other=float("-inf")).to(tl.float32) * inv_t
        z2 = tl.load(x_ptr + i2, mask=i2 < hi, other=float("-inf")).to(tl.float32) * inv_t
        z3 = tl.load(x_ptr + i3, mask=i3 < hi, other=float("-inf")).to(tl.float32) * inv_t
        u0, u1, u2, u3 = s, s, s, s  # unused when greedy
        if not GREEDY:
            u0, u1, u2, u3 = tl.rand4x(seed, base // 4 + lane)  # counters unique in the row
        m, s, sk, t, best, bidx = _update(z0, i0, u0, thr, m, s, sk, t, best, bidx, GREEDY, FILTER)
        m, s, sk, t, best, bidx = _update(z1, i1, u1, thr, m, s, sk, t, best, bidx, GREEDY, FILTER)
        m, s, sk, t, best, bidx = _update(z2, i2, u2, thr, m, s, sk, t, best, bidx, GREEDY, FILTER)
        m, s, sk, t, best, bidx = _update(z3, i3, u3, thr, m, s, sk, t, best, bidx, GREEDY, FILTER)
    mm, ss, ssk, tt, bb, tok = _combine(m, s, sk, t, best, bidx)
    out = part_ptr + (row * tl.num_programs(1) + sl) * 5
    tl.store(out, mm)
    tl.store(out + 1, ss)
    tl.store(out + 2, tt)
    tl.store(out + 3, bb)
    tl.store(out + 4, ssk)
    tl.store(ipart_ptr + row * tl.num_programs(1) + sl, tok)


@triton.jit
def _finish_kernel(x_ptr, stride_x, temp_ptr, part_ptr, ipart_ptr, tok_ptr, lp_ptr, ent_ptr, NS,
                   NS_PAD: tl.constexpr):
    # row: combine its NS slices; token = the best key's index (the first of equal keys), its
    # log-prob z[tok] - M - log(Sk) under the kept logits, entropy log S - sum p (z - M) with S, Sk, M
    # the combined sums and max
    row = tl.program_id(0)
    k = tl.arange(0, NS_PAD)
    p = part_ptr + (row * NS + k) * 5
    live = k < NS
    m = tl.load(p, mask=live, other=-1e30)
    s = tl.load(p + 1, mask=live, other=0.0)
    t = tl.load(p + 2, mask=live, other=0.0)
    best = tl.load(p + 3, mask=live, other=float("-inf"))
    sk = tl.load(p + 4, mask=live, other=0.0)
    idx = tl.load(ipart_ptr + row * NS + k, mask=live, other=2147483647)
    mm, ss, ssk, tt, _, tok = _combine(m, s, sk, t, best, idx)
    z = tl.load(x_ptr + row.to(tl.int64) * stride_x + tok).to(tl.float32) * (1.0 / tl.load(temp_ptr))
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(lp_ptr + row, z - mm - tl.log(ssk))
    tl.store(ent_ptr + row, tl.log(ss) - tt / ss)


class Filters(NamedTuple):
    """Which of HF's filters a decode step applies (a captured step's shape: part of its graph's key);
    their values come from the step's buffers (top-p, min-p) or this (top-k)."""

    top_p: bool = False
    top_k: int = 0
    min_p: bool = False


def keep_threshold(logits: Tensor, temperature: Tensor, top_k: int, min_p: Tensor | None) -> Tensor:
    """The least tempered logit z = logit * (1 / T) each row keeps under top-k and min-p (HF's: the
    k-th largest, ties kept; the largest plus log(min_p)), float32 [B], computed as `fused_sample`
    computes z, so that the k-th largest is kept exactly. Graph-safe."""
    inv_t = 1.0 / temperature
    thr = torch.full((logits.shape[0],), float("-inf"), dtype=torch.float32, device=logits.device)
    if top_k:
        thr = torch.topk(logits, min(top_k, logits.shape[1]), dim=-1).values[:, -1].float() * inv_t
    if min_p is not None:
        thr = torch.maximum(thr, logits.amax(dim=-1).float() * inv_t + torch.log(min_p))
    return thr


def fused_sample(logits: Tensor, temperature: Tensor, seed: Tensor, step: Tensor, greedy: bool,
                 slices: int | None = None, keep: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`sample(logits, temperature, _, greedy, use_top_p=False, top_k=..., min_p=...)` in two Triton
    launches, graph-safe.

    Args:
        logits: [B, V] (bf16 or fp32; read as fp32), rows contiguous.
        temperature: float32 [1] device tensor (1 when greedy: the log-probs' and entropy's).
        seed, step: int64 [1] device tensors; row b's noise is Philox keyed by seed + 65536 step + b
            (so at most 65536 rows), token v's at a counter that depends on v alone: each decode step
            draws anew and replays need no host work.
        greedy: the first index of the largest logit, no noise.
        slices: about how many programs take each row (default: ~8 programs an SM over all rows, so
            loads overlap); the draw is the same for any.
        keep: float32 [B]: draw only among the tempered logits z >= keep[b] (`keep_threshold`: top-k
            and min-p); None keeps all. Ignored when greedy.

    Returns:
        (token long [B], its log-prob under the kept logits' softmax(z) [B], the entropy of the
        whole softmax(logits / T) [B]).
    """
    b, v = logits.shape
    if logits.stride(1) != 1 or b > 65536:
        raise ValueError(f"fused_sample takes up to 65536 rows of contiguous logits, not {tuple(logits.shape)} "
                         f"with strides {logits.stride()}")
    if slices is None:  # few rows split each row into more slices
        slices = min(128, pow2(-(-8 * sm_count(logits.device) // b), lo=1))
    chunk = -(-v // (slices * 4 * Q)) * 4 * Q  # whole Philox blocks, so noise does not depend on it
    slices = -(-v // chunk)
    part = torch.empty(b, slices, 5, dtype=torch.float32, device=logits.device)
    ipart = torch.empty(b, slices, dtype=torch.int32, device=logits.device)
    tok = torch.empty(b, dtype=torch.long, device=logits.device)
    lp = torch.empty(b, dtype=torch.float32, device=logits.device)
    ent = torch.empty(b, dtype=torch.float32, device=logits.device)
    filtered = keep is not None and not greedy
    _partial_kernel[(b, slices)](logits, logits.stride(0), v, temperature, seed, step, keep if filtered else lp, part,
                                 ipart, chunk, GREEDY=greedy, FILTER=filtered, Q=Q, num_warps=4)
    _finish_kernel[(b,)](logits, logits.stride(0), temperature, part, ipart, tok, lp, ent, slices,
                         NS_PAD=pow2(slices, lo=2), num_warps=1)
    return tok, lp, ent


def sample(logits: Tensor, temperature: Tensor, top_p: Tensor, greedy: bool, use_top_p: bool,
           generator: torch.Generator | None = None, top_k: int = 0,
           min_p: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Sample one token per row on the device (graph-safe: no host sync).

    Args:
        logits: [B, V] (bf16 logits are taken in fp32). temperature / top_p: float32 [1] device tensors.
        greedy: argmax (log-probs and entropy then use temperature 1; no filter applies).
        use_top_p: apply HF's top-p filter (keep the smallest set of tokens whose mass exceeds
            top_p, at least one) after top-k.
        generator: only used outside graphs (the CPU path).
        top_k: HF's top-k filter first (the k largest, ties kept); 0: none.
        min_p: float32 [1] device tensor: HF's min-p filter last (drop tokens less likely than min_p
            times the most likely); None: none.

    Returns:
        (token long [B], its log-prob under the filtered, renormalised softmax(logits / T) it was
        drawn from [B], the entropy of the whole softmax(logits / T) [B]).
    """
    logits = logits.float()
    lp = torch.log_softmax(logits if greedy else logits / temperature, dim=-1)
    ent = -(lp.exp() * lp.clamp_min(torch.finfo(lp.dtype).min)).sum(-1)
    if greedy:
        tok = lp.argmax(-1)
        return tok, lp.gather(1, tok[:, None])[:, 0], ent
    filt = lp
    if top_k:
        kth = torch.topk(filt, min(top_k, filt.shape[1]), dim=-1).values[:, -1:]
        filt = filt.masked_fill(filt < kth, float("-inf"))
    if use_top_p:
        kept = torch.log_softmax(filt, dim=-1) if top_k else filt  # top-p's mass is the top-k's, renormalised
        srt, idx = torch.sort(kept, dim=-1)  # ascending, as HF's TopPLogitsWarper
        remove = srt.exp().cumsum(-1) <= 1 - top_p
        remove[:, -1] = False
        filt = filt.masked_fill(remove.scatter(1, idx, remove), float("-inf"))
    if min_p is not None:
        filt = filt.masked_fill(filt < filt.amax(dim=-1, keepdim=True) + torch.log(min_p), float("-inf"))
    e = torch.empty_like(filt).exponential_(generator=generator).clamp_min_(torch.finfo(filt.dtype).tiny)
    tok = (filt - e.log()).argmax(-1)  # Gumbel-max: a draw from softmax(filt)
    return tok, torch.log_softmax(filt, dim=-1).gather(1, tok[:, None])[:, 0], ent
