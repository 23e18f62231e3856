"""The prefill: the prompts run through the model once, filling the KV cache, the first token's
logits returned (`prefill`); its linears are cuBLAS products with Triton launches around them
(`_prefill_linear`: one `norm_shrink` before, one `prefill_epilogue` pass over each base output
after); `share_prompts` gives a group's prefilled cache slots to the rows that repeat its prompt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from qerl_exp.decoders import blocks
from qerl_exp.engine.decode import Cache, LinearGroup, Model, qk_norm
from qerl_exp.engine.norm import norm_shrink
from qerl_exp.engine.rope_cache import rope_cache
from qerl_exp.engine.triton_util import pow2, tl, triton
from qerl_exp.quant.layout import weight_of


@triton.jit
def _lora_fp32(y_ptr, t_ptr, b_ptr, scale, stride, stride_t, offs_m, offs_n, m_ok, n_ok, r, R: tl.constexpr):
    # y + scale * t @ B^T over one tile, in fp32 (peft: the bf16 base output plus the LoRA term
    # in the adapters' dtype, promoted to fp32)
    y = tl.load(y_ptr + offs_m[:, None] * stride + offs_n[None, :], mask=m_ok[:, None] & n_ok[None, :],
                other=0.0).to(tl.float32)
    if R > 0:
        rr = tl.arange(0, R)
        tt = tl.load(t_ptr + offs_m[:, None] * stride_t + rr[None, :], mask=m_ok[:, None] & (rr[None, :] < r),
                     other=0.0).to(tl.float32)
        bb = tl.load(b_ptr + offs_n[None, :] * r + rr[:, None], mask=n_ok[None, :] & (rr[:, None] < r),
                     other=0.0).to(tl.float32)
        # tf32x3: fp32 accuracy on tensor cores (an ieee dot runs on the far slower FMA units)
        y += tl.dot(tt, bb, input_precision="tf32x3") * scale
    return y


@triton.jit
def _prefill_epilogue_kernel(
    y_ptr, y2_ptr, stride_y, t_ptr, t2_ptr, stride_t, b_ptr, b2_ptr, scale, scale2,
    res_ptr, stride_r, out_ptr, stride_o, M, N, r,
    GLU: tl.constexpr, HAS_RES: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # out = y + scale * t @ B^T (R = 0: no LoRA), rounded once; GLU: silu(out) * (the same of
    # y2, t2, B2), each rounded as HF; HAS_RES: + res after rounding (HF's residual add)
    ACT = out_ptr.dtype.element_ty
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    ok = m_ok[:, None] & n_ok[None, :]
    y = _lora_fp32(y_ptr, t_ptr, b_ptr, scale, stride_y, stride_t, offs_m, offs_n, m_ok, n_ok, r, R)
    if GLU:
        u = _lora_fp32(y2_ptr, t2_ptr, b2_ptr, scale2, stride_y, stride_t, offs_m, offs_n, m_ok, n_ok, r, R)
        g = y.to(ACT).to(tl.float32)
        y = (g * tl.sigmoid(g)).to(ACT).to(tl.float32) * u.to(ACT).to(tl.float32)
    if HAS_RES:
        res = tl.load(res_ptr + offs_m[:, None] * stride_r + offs_n[None, :], mask=ok, other=0.0)
        y = y.to(ACT).to(tl.float32) + res.to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_o + offs_n[None, :], y.to(ACT), mask=ok)


def prefill_epilogue(y: Tensor, out: Tensor, *, t: Tensor | None = None, b: Tensor | None = None,
                     scale: float = 0.0, y2: Tensor | None = None, t2: Tensor | None = None,
                     b2: Tensor | None = None, scale2: float = 0.0, residual: Tensor | None = None) -> Tensor:
    """Triton: what a prefill linear adds to its cuBLAS base output, in one pass over it.

    out = y + scale * t @ b^T, summed in fp32 and rounded once (peft's LoRA under a bf16 base, as
    peft's addmm); with y2 (GLU: y gate, y2 up) out = silu(that) * (y2 + scale2 *
    t2 @ b2^T), each rounded where HF rounds; with residual, + residual after rounding.

    Args:
        y, y2: [M, N] base outputs (model dtype, rows contiguous, the same stride).
        t, t2: [M, r] LoRA shrinks (adapter dtype, the same stride); b, b2: [N, r] LoRA B,
            contiguous. None: no LoRA.
        residual: [M, N], may alias out. out: [M, N] (a column slice of a wider buffer is fine).
    """
    m, n = y.shape
    r = b.shape[1] if b is not None else 0
    dummy = y if t is None else t
    block_n = 128 if n >= 128 else pow2(n)
    _prefill_epilogue_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, 32))](
        y, y2 if y2 is not None else y, y.stride(0), dummy, t2 if t2 is not None else dummy,
        t.stride(0) if t is not None else 0, b if b is not None else dummy, b2 if b2 is not None else dummy,
        scale, scale2, residual if residual is not None else y, residual.stride(0) if residual is not None else 0,
        out, out.stride(0), m, n, max(r, 1),
        GLU=y2 is not None, HAS_RES=residual is not None, R=pow2(r) if r else 0, BLOCK_M=32, BLOCK_N=block_n,
        num_warps=4,
    )
    return out


def _prefill_linear(lin: LinearGroup, x: Tensor, scratch: Tensor | None, residual: Tensor | None = None,
                    norm: tuple | None = None) -> Tensor:
    """A linear group over the prompts, HF's and peft's result: base (+ bias) + lora_B(lora_A(x')) *
    scaling per projection (GLU: silu(gate) * up) (+ residual), x' = x or RMSNorm(x) * gamma with
    `norm` = (gamma, eps), rounded where they round (the LoRA term in the adapters' dtype, fp32
    under a bf16 base). One `norm_shrink` launch (the norm and the fp32 LoRA shrink of all
    segments, where torch makes ~10 launches and an fp32 copy of x), each segment's cuBLAS product
    (4-bit weights dequantized into `scratch` first, `layout.weight_of`), and one Triton pass over
    each base output (`prefill_epilogue`: LoRA term, GLU, residual) where torch makes five
    (casts, a copy, addmm) and a concatenation. The fp32 sums (the norm's mean, the shrink, the
    LoRA term) may differ from torch's in their last bits (another summation order)."""
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    res = residual.reshape(x.shape[0], -1) if residual is not None else None
    ts = bs = [None] * len(lin.weights)
    if norm is not None or lin.lora_a is not None:
        h = torch.empty_like(x) if norm is not None else None
        width = pow2(lin.r)  # norm_shrink's padded rank
        t = torch.zeros(x.shape[0], len(lin.weights) * width, device=x.device) if lin.lora_a is not None else None
        gamma, eps = norm or (None, 0.0)
        norm_shrink(x, gamma, eps, h, lin.a_tab, len(lin.weights), lin.r, t,
                    lin.lora_a[0].dtype if lin.lora_a is not None else None, exact=True)
        if h is not None:
            x = h
        if t is not None:
            ts, bs = [t[:, s * width:s * width + lin.r] for s in range(len(lin.weights))], lin.lora_b
    ys = [F.linear(x, weight_of(w, x.dtype, scratch), b) for w, b in zip(lin.weights, lin.biases)]
    if lin.glu:
        out = torch.empty_like(ys[0])
        prefill_epilogue(ys[0], out, t=ts[0], b=bs[0], scale=lin.scale[0], y2=ys[1], t2=ts[1], b2=bs[1],
                         scale2=lin.scale[1], residual=res)
        return out.view(*lead, -1)
    out = torch.empty(x.shape[0], sum(y.shape[1] for y in ys), dtype=x.dtype, device=x.device)
    col = 0
    for y, t, b, sc in zip(ys, ts, bs, lin.scale):  # q, k, v: each into its columns, no concatenation
        cols = slice(col, col + y.shape[1])
        prefill_epilogue(y, out[:, cols], t=t, b=b, scale=sc, residual=res[:, cols] if res is not None else None)
        col = cols.stop
    return out.view(*lead, -1)


def prefill(m: Model, cache: Cache, ids: Tensor, mask: Tensor, scratch: Tensor | None = None) -> Tensor:
    """Run the left-padded prompts [B, P], fill cache slots 0..P-1, return last logits [B, V] fp32.

    Each linear is `_prefill_linear` (cuBLAS with Triton launches around it); rope and the cache
    writes are one `rope_cache` launch; the grouped-query heads are folded into the query length,
    so no K/V repeat. Rounded where HF rounds. `scratch`: a flat buffer as large as the largest
    4-bit weight, which NVFP4 weights are dequantized into one linear at a time (`FastEngine.scratch`)."""
    b, p = ids.shape
    pos = (mask.long().cumsum(1) - 1).clamp_min(0)  # HF: position ids from the attention mask
    ar = torch.arange(p, device=ids.device)
    allowed = (ar[None, :] <= ar[:, None])[None] & mask.bool()[:, None, :]
    allowed |= torch.eye(p, dtype=torch.bool, device=ids.device)[None]  # pad rows see themselves
    bias = torch.zeros(b, 1, p, p, dtype=m.embed.dtype, device=ids.device)
    bias.masked_fill_(~allowed[:, None], float("-inf"))
    x = F.embedding(ids, m.embed)
    g = m.hq // m.hkv
    x = x.view(b * p, -1)
    pos, first = pos.view(-1), torch.zeros(1, dtype=torch.long, device=ids.device)
    bias = bias.repeat(1, 1, g, 1)  # query row j * P + i of a kv head: head j of its group, token i
    for li, ly in enumerate(m.layers):
        qkv = _prefill_linear(ly.qkv, x, scratch, norm=(ly.ln1, ly.eps))
        q = torch.empty(b, m.hq, p, m.d, dtype=x.dtype, device=x.device)
        rope_cache(qkv, m.cos, m.sin, pos, first, q, cache.k[li], cache.v[li], m.hq, m.hkv, m.d, p, qk_norm(ly))
        k, v = cache.k[li, :b, :, :p], cache.v[li, :b, :, :p]
        # [B, hkv, G P, d] -> [B, hq, P, d]; SDPA may return it strided (fp32 on CUDA), so no view
        att = F.scaled_dot_product_attention(q.view(b, m.hkv, g * p, m.d), k, v, attn_mask=bias,
                                             scale=m.scaling).unflatten(2, (g, p)).flatten(1, 2)
        att = att.transpose(1, 2).reshape(*x.shape[:-1], m.hq * m.d)
        x = _prefill_linear(ly.o, att, scratch, residual=x)
        inter = _prefill_linear(ly.gate_up, x, scratch, norm=(ly.ln2, ly.eps))
        x = _prefill_linear(ly.down, inter, scratch, residual=x)
    last = x.view(b, p, -1)[:, -1]
    return F.linear(blocks.rms_norm(last, m.norm, m.eps), m.lm_head).float()


def share_prompts(cache: Cache, prompts: int, group: int, p: int) -> None:
    """Give each of `prompts` prefilled rows' cache slots 0..p-1 to the `group` adjacent rows that
    share its prompt (rows g * group .. (g + 1) * group - 1 get row g's), in place: from the last
    prompt down, so no row is overwritten before it is read."""
    for g in reversed(range(prompts)):
        first = g * group + (1 if g == 0 else 0)  # row 0 already holds its own
        for kv in (cache.k, cache.v):
            kv[:, first : (g + 1) * group, :, :p] = kv[:, g : g + 1, :, :p]
