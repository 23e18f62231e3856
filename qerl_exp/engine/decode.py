"""The decode path of `FastEngine` (`fast_engine`): gpt-fast style rollouts for HF
Llama/Qwen2-family causal LMs, as free functions.

A static KV cache (`setup_caches`), a `prefill()`, and a `decode_one_token()` step (forward,
sampling on the device, per-sequence EOS bookkeeping) that `FastEngine` captures once per batch
size in a CUDA graph and replays `max_new_tokens - 1` times (`decode_n_tokens`).

The engine holds the HF model's own tensors (dense base weights, LoRA A/B, RMSNorm scales,
embeddings, lm_head), and its Triton kernels read them through address tables, so an optimizer
step on the LoRA parameters or AQN noise added in place to `input_layernorm.weight` /
`post_attention_layernorm.weight` is seen by the next replay without a recapture. `FP4Linear`
bases (NVFP4/MXFP4) convert themselves to the kernels' layout (`layout.PackedWeight`) and the
learner decodes from it too: one copy. bitsandbytes NF4 `Linear4bit` bases are re-laid out once,
at build time, into a second copy (`FastEngine.nbytes` counts it with the KV cache). LoRA is
applied unmerged: `y = base(x) + (x @ A^T) @ B^T * scaling`. If a referenced tensor is
re-allocated (`p.data = ...`), the next `generate` notices and rebuilds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qerl_exp.engine.attention import attention_workspace, decode_attention
from qerl_exp.engine.launch import norm_shrink, prefill_epilogue, rope_cache
from qerl_exp.engine.layout import PackedWeight, relayout_nf4, weight_of
from qerl_exp.engine.linear import LinearPlan, fused_linear
from qerl_exp.engine.sampling import Filters, fused_sample, keep_threshold, sample
from qerl_exp.engine.triton_kernels import pow2

PREFILL_GRAPHS = 8  # most (batch, prompt length) shapes whose prefill a FastEngine keeps captured
MAX_EOS = 8  # most token ids that end a sequence (instruct checkpoints name two or three)


@dataclass
class GenerateOutput:
    """What `FastEngine.generate` (and the HF rollout path) returns; T = longest completion.

    Args:
        completion_ids: long [B, T], right-padded with pad_id after the first EOS (EOS kept).
        completion_mask: bool [B, T], True up to and including the first EOS.
        logprobs: float32 [B, T], log-prob of each sampled token under the distribution it was
            drawn from: softmax(logits / T) cut by top-k, top-p and min-p and renormalised; 0 where
            the mask is False. With temperature 0 (greedy): T = 1, nothing cut.
        entropy: float32 [B, T], entropy of the uncut softmax(logits / temperature); 0 where masked.
    """

    completion_ids: Tensor
    completion_mask: Tensor
    logprobs: Tensor
    entropy: Tensor


# ---------------------------------------------------------------------------------------------
# The model as the engine sees it: references into the HF module tree
# ---------------------------------------------------------------------------------------------


@dataclass
class _Linear:
    """1-3 projections sharing one input (q/k/v; gate/up as GLU; o; down), as one launch."""

    fmt: str
    weights: list  # Tensor (the model's own dense weight) or layout.PackedWeight
    biases: list
    lora_a: list | None  # the model's own LoRA A [r, K] per projection
    lora_b: list | None  # ... and B [N, r]
    scale: list
    r: int
    glu: bool
    sources: list  # the base layers the weights were read from (an in-place requantize_ is seen)
    updates: list  # each source's `updates` count when read (None: not an FP4Linear)
    plan: LinearPlan | None = None
    a_tab: Tensor | None = None


@dataclass
class _Layer:
    ln1: Tensor
    ln2: Tensor
    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear


@dataclass
class _Model:
    embed: Tensor
    norm: Tensor
    lm_head: Tensor
    layers: list
    eps: float
    hq: int
    hkv: int
    d: int
    scaling: float
    cos: Tensor  # [S, d]
    sin: Tensor


def _split_lora(mod: nn.Module):
    """(base layer, (A, B, scaling) or None) of a projection, peft-wrapped or not."""
    if hasattr(mod, "base_layer") and hasattr(mod, "lora_A"):
        if getattr(mod, "merged", False):
            raise ValueError("FastEngine needs unmerged LoRA adapters (call unmerge_adapter())")
        active = [] if getattr(mod, "disable_adapters", False) else [a for a in mod.active_adapters if a in mod.lora_A]
        if len(active) > 1:
            raise NotImplementedError(f"FastEngine supports one active adapter, found {active}")
        base = mod.get_base_layer()
        if not active:
            return base, None
        a = active[0]
        if getattr(mod, "use_dora", {}).get(a, False):
            raise NotImplementedError("DoRA adapters are not supported by FastEngine")
        return base, (mod.lora_A[a].weight, mod.lora_B[a].weight, float(mod.scaling[a]))
    return mod, None


def _base_weight(base: nn.Module):
    """(format, weight, bias): the dense weight itself, or the 4-bit one in the kernel layout (an
    `FP4Linear` on CUDA converts itself to it, so the engine holds no second copy; NF4 is laid out
    again here, a copy counted by `FastEngine.nbytes`)."""
    if callable(getattr(base, "kernel_weight", None)):  # FP4Linear (NVFP4, MXFP4)
        return base.format, base.kernel_weight(), base.bias
    qs = getattr(getattr(base, "weight", None), "quant_state", None)
    if qs is not None:  # bitsandbytes Linear4bit
        import bitsandbytes.functional as bnbf

        if qs.quant_type != "nf4":
            raise NotImplementedError(f"bitsandbytes quant_type {qs.quant_type!r}: only nf4 is supported")
        deq = bnbf.dequantize_4bit(base.weight.data, qs)
        absmax = qs.absmax
        if qs.nested:
            absmax = bnbf.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
        return "nf4", relayout_nf4(deq, absmax.float(), qs.code, qs.blocksize), base.bias
    if isinstance(base, nn.Linear):
        return "dense", base.weight, base.bias
    raise TypeError(f"FastEngine cannot read a {type(base).__name__} projection")


def stack_dense(weights: list[Tensor]) -> Tensor:
    """One launch's dense weights as one [sum of rows, K] tensor, so that cuBLAS multiplies them in one
    GEMM (7B q/k/v at 64 rows: 11.2 us a layer against 23.8 for three GEMMs and two split-K reduces,
    `bench/step_profile.py --batch 64 --formats bf16_cublas`, H200).

    The model's parameters are re-pointed to its row blocks (`p.data = ...`), so the values stay
    stored once and in-place updates (an optimizer step, a noise hook) are seen by the engine's GEMM.
    Weights that already lie so, one after another in one storage (an earlier engine stacked them),
    are viewed, not copied again.
    """
    first = weights[0]
    if len(weights) == 1:
        return first
    offset, stacked_already = first.storage_offset(), True
    for w in weights:
        stacked_already &= (w.is_contiguous() and w.storage_offset() == offset
                            and w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())
        offset += w.numel()
    rows = sum(w.shape[0] for w in weights)
    if stacked_already:
        return first.detach().as_strided((rows, first.shape[1]), (first.shape[1], 1))
    stacked = torch.cat([w.detach() for w in weights])
    row = 0
    for w in weights:
        w.data = stacked[row: row + w.shape[0]]
        row += w.shape[0]
    return stacked


def _group(mods: list[nn.Module], glu: bool = False) -> _Linear:
    split = [_split_lora(m) for m in mods]
    sources = [base for base, _ in split]
    updates = [getattr(base, "updates", None) for base in sources]
    parts = [(_base_weight(b), lora) for b, lora in split]
    fmts = {p[0][0] for p in parts}
    if len(fmts) != 1:
        raise NotImplementedError(f"mixed weight formats in one projection group: {sorted(fmts)}")
    weights = [p[0][1] for p in parts]
    biases = [p[0][2] for p in parts]
    loras = [p[1] for p in parts]
    lora_a = lora_b = None
    scale = [0.0] * len(mods)
    r = 0
    if any(lo is not None for lo in loras):
        ranks = {lo[0].shape[0] for lo in loras if lo is not None}
        if len(ranks) != 1:
            raise NotImplementedError(f"LoRA ranks differ inside one projection group: {sorted(ranks)}")
        r = ranks.pop()
        ref = next(lo for lo in loras if lo is not None)[0]
        lora_a, lora_b = [], []
        for (fw, w, _), lo in zip((p[0] for p in parts), loras):
            if lo is None:  # a projection without adapter in a group with one: zero LoRA
                n = w.n if isinstance(w, PackedWeight) else w.shape[0]
                lo = (torch.zeros_like(ref), torch.zeros(n, r, dtype=ref.dtype, device=ref.device), 0.0)
            lora_a.append(lo[0])
            lora_b.append(lo[1])
        scale = [lo[2] if lo is not None else 0.0 for lo in loras]
    return _Linear(next(iter(fmts)), weights, biases, lora_a, lora_b, scale, r, glu, sources, updates)


def _causal_lm(model: nn.Module) -> nn.Module:
    m = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not (hasattr(m, "model") and hasattr(m.model, "layers") and hasattr(m, "lm_head")):
        raise TypeError(f"{type(m).__name__} is not a Llama/Qwen2-style causal LM (model.layers, lm_head)")
    return m


def _projections(blk: nn.Module) -> dict[str, list[nn.Module]]:
    """A decoder block's projections, grouped as the engine launches them (`_Layer`'s fields)."""
    at, mlp = blk.self_attn, blk.mlp
    return {"qkv": [at.q_proj, at.k_proj, at.v_proj], "o": [at.o_proj],
            "gate_up": [mlp.gate_proj, mlp.up_proj], "down": [mlp.down_proj]}


def base_layers(model: nn.Module) -> list[nn.Module]:
    """The base layer of every projection, in the order `build_model` reads them: the engine
    compares it with what it read to notice a replaced layer."""
    return [_split_lora(mod)[0] for blk in _causal_lm(model).model.layers
            for mods in _projections(blk).values() for mod in mods]


def build_model(model: nn.Module, max_seq_len: int) -> _Model:
    """Collect references to every tensor the engine reads (and re-lay out 4-bit bases)."""
    lm = _causal_lm(model)
    dec = lm.model
    cfg = lm.config
    head, _ = _split_lora(lm.lm_head)
    if _ is not None:
        raise NotImplementedError("LoRA on lm_head is not supported by FastEngine")
    layers = [_Layer(ln1=blk.input_layernorm.weight, ln2=blk.post_attention_layernorm.weight,
                     **{name: _group(mods, glu=name == "gate_up") for name, mods in _projections(blk).items()})
              for blk in dec.layers]
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    emb = dec.embed_tokens.weight
    pos = torch.arange(max_seq_len, device=emb.device)[None]
    cos, sin = dec.rotary_emb(emb[:1][None], pos)
    return _Model(
        embed=emb, norm=dec.norm.weight, lm_head=head.weight, layers=layers,
        eps=float(getattr(cfg, "rms_norm_eps", 1e-6)), hq=cfg.num_attention_heads,
        hkv=cfg.num_key_value_heads, d=d, scaling=float(getattr(dec.layers[0].self_attn, "scaling", d ** -0.5)),
        cos=cos[0].contiguous(), sin=sin[0].contiguous(),
    )


def _tracked(m: _Model) -> list[Tensor]:
    out = [m.embed, m.norm, m.lm_head]
    for ly in m.layers:
        out += [ly.ln1, ly.ln2]
        for lin in (ly.qkv, ly.o, ly.gate_up, ly.down):
            out += [w for w in lin.weights if isinstance(w, Tensor)] + [b for b in lin.biases if b is not None]
            out += (lin.lora_a or []) + (lin.lora_b or [])
    return out


# ---------------------------------------------------------------------------------------------
# Caches and per-batch state
# ---------------------------------------------------------------------------------------------


@dataclass
class _Cache:
    k: Tensor  # [L, B_max, hkv, S, d]
    v: Tensor


def setup_caches(m: _Model, max_batch_size: int, max_seq_len: int, cache: _Cache | None = None) -> _Cache:
    """Allocate the static KV cache once; reuse `cache` when it is already large enough."""
    shape = (len(m.layers), max_batch_size, m.hkv, max_seq_len, m.d)
    if cache is not None and all(a >= b for a, b in zip(cache.k.shape, shape)):
        return cache
    kw = dict(dtype=m.embed.dtype, device=m.embed.device)
    return _Cache(torch.zeros(shape, **kw), torch.zeros(shape, **kw))


class _State:
    """Static per-batch-size buffers that the captured decode step reads and writes."""

    def __init__(self, m: _Model, b: int, s: int, rt: int):
        dev, dt = m.embed.device, m.embed.dtype
        z = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        self.b = b
        self.tok, self.pos, self.pad = z(b), z(b), z(b)
        self.slot, self.step = z(1), z(1)
        self.done = z(b, dtype=torch.bool)
        self.temperature, self.top_p = z(1, dtype=torch.float32) + 1, z(1, dtype=torch.float32) + 1
        self.min_p = z(1, dtype=torch.float32)
        self.eos, self.pad_id = z(MAX_EOS) - 1, z(1)  # -1: an unused slot (no token matches it)
        self.out_tok, self.out_mask = z(b, s), z(b, s, dtype=torch.bool)
        self.out_lp, self.out_ent = z(b, s, dtype=torch.float32), z(b, s, dtype=torch.float32)
        self.arange = torch.arange(s, device=dev)
        self.t = z(len(m.layers), 4, b, rt, dtype=torch.float32)  # LoRA shrink accumulators
        h = m.embed.shape[1]
        self.ss = z(h // 16, b, dtype=torch.float32)  # partial sums of squares of the residual rows
        self.h = torch.zeros(b, h, dtype=dt, device=dev)
        self.q = torch.zeros(b, m.hq, m.d, dtype=dt, device=dev)
        self.att = torch.zeros(b, m.hq * m.d, dtype=dt, device=dev)
        self.att_work = attention_workspace(b, m.hq, m.hkv, m.d, dev)  # split runs of long contexts
        self.generator: torch.Generator | None = None
        self.seed = z(1)  # fused_sample's noise key, drawn anew each generate


# ---------------------------------------------------------------------------------------------
# Forward pieces
# ---------------------------------------------------------------------------------------------


def _rms_norm(x: Tensor, gamma: Tensor, eps: float) -> Tensor:
    """HF Llama/Qwen2 RMSNorm, rounding exactly where HF rounds."""
    xf = x.float()
    return gamma * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _prefill_linear(lin: _Linear, x: Tensor, scratch: Tensor | None, residual: Tensor | None = None,
                    norm: tuple | None = None) -> Tensor:
    """A linear group over the prompts, HF's and peft's result: base (+ bias) + lora_B(lora_A(x')) *
    scaling per projection (GLU: silu(gate) * up) (+ residual), x' = x or RMSNorm(x) * gamma with
    `norm` = (gamma, eps), rounded where they round (the LoRA term in the adapters' dtype, fp32
    under a bf16 base). One `norm_shrink` launch (the norm and the fp32 LoRA shrink of all
    segments, where torch makes ~10 launches and an fp32 copy of x), each segment's cuBLAS product
    (4-bit weights dequantized into `scratch` first, `layout.weight_of`), and one Triton pass over
    each base output (`launch.prefill_epilogue`: LoRA term, GLU, residual) where torch makes five
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


def prefill(m: _Model, cache: _Cache, ids: Tensor, mask: Tensor, scratch: Tensor | None = None) -> Tensor:
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
        qkv = _prefill_linear(ly.qkv, x, scratch, norm=(ly.ln1, m.eps))
        q = torch.empty(b, m.hq, p, m.d, dtype=x.dtype, device=x.device)
        rope_cache(qkv, m.cos, m.sin, pos, first, q, cache.k[li], cache.v[li], m.hq, m.hkv, m.d, p)
        k, v = cache.k[li, :b, :, :p], cache.v[li, :b, :, :p]
        # [B, hkv, G P, d] -> [B, hq, P, d]; SDPA may return it strided (fp32 on CUDA), so no view
        att = F.scaled_dot_product_attention(q.view(b, m.hkv, g * p, m.d), k, v, attn_mask=bias,
                                             scale=m.scaling).unflatten(2, (g, p)).flatten(1, 2)
        att = att.transpose(1, 2).reshape(*x.shape[:-1], m.hq * m.d)
        x = _prefill_linear(ly.o, att, scratch, residual=x)
        inter = _prefill_linear(ly.gate_up, x, scratch, norm=(ly.ln2, m.eps))
        x = _prefill_linear(ly.down, inter, scratch, residual=x)
    last = x.view(b, p, -1)[:, -1]
    return F.linear(_rms_norm(last, m.norm, m.eps), m.lm_head).float()


def share_prompts(cache: _Cache, prompts: int, group: int, p: int) -> None:
    """Give each of `prompts` prefilled rows' cache slots 0..p-1 to the `group` adjacent rows that
    share its prompt (rows g * group .. (g + 1) * group - 1 get row g's), in place: from the last
    prompt down, so no row is overwritten before it is read."""
    for g in reversed(range(prompts)):
        first = g * group + (1 if g == 0 else 0)  # row 0 already holds its own
        for kv in (cache.k, cache.v):
            kv[:, first : (g + 1) * group, :, :p] = kv[:, g : g + 1, :, :p]


def _forward(m: _Model, cache: _Cache, st: _State) -> Tensor:
    # one token per sequence (st.tok [B] at cache slot st.slot, rotary position st.pos [B]), per
    # layer: qkv (norm and LoRA shrink, on load where the kernel does), rope + cache, attention, o
    # (+ its shrink, residual), gate/up (norm, shrink; GLU and the down shrink in the epilogue),
    # down (+ residual); each linear a base-product launch and an epilogue (`linear.fused_linear`)
    b = st.b
    x = F.embedding(st.tok, m.embed)  # [B, H], updated in place by the residual epilogues
    st.t.zero_()
    st.ss.zero_()  # later rows are written by the residual epilogues (ss_out), row 0 here
    st.ss[0] = x.float().pow(2).sum(-1)
    for li, ly in enumerate(m.layers):
        t = st.t[li]  # [4, B, RT]
        lora = [lin.a_tab is not None for lin in (ly.qkv, ly.o, ly.gate_up, ly.down)]
        qkv_out = torch.empty(b, ly.qkv.plan.n, dtype=x.dtype, device=x.device)
        fused_linear(ly.qkv.plan, x, qkv_out, t=t[0] if lora[0] else None, norm=(ly.ln1, m.eps, st.ss),
                     shrink=ly.qkv.a_tab)
        rope_cache(qkv_out, m.cos, m.sin, st.pos, st.slot, st.q, cache.k[li], cache.v[li], m.hq, m.hkv, m.d)
        att = decode_attention(st.q, cache.k[li], cache.v[li], st.pad, st.slot, m.scaling, st.att, st.att_work)
        fused_linear(ly.o.plan, att, x, t=t[1] if lora[1] else None, shrink=ly.o.a_tab, residual=x, ss_out=st.ss)
        # where down takes nvfp4_wgmma, the GLU epilogue writes its operand (inter / 16 in fp16)
        down16 = ly.down.plan.takes_x16(b, x.device)
        inter = torch.empty(b, ly.gate_up.plan.n, dtype=torch.float16 if down16 else x.dtype, device=x.device)
        fused_linear(ly.gate_up.plan, x, inter, t=t[2] if lora[2] else None, norm=(ly.ln2, m.eps, st.ss),
                     shrink=ly.gate_up.a_tab, a_next=ly.down.lora_a[0] if lora[3] else None,
                     t_next=t[3] if lora[3] else None, r_next=ly.down.r, out16=down16)
        fused_linear(ly.down.plan, inter, x, t=t[3] if lora[3] else None, residual=x, ss_out=st.ss, x16=down16)
    norm_shrink(x, m.norm, m.eps, st.h, None, 1, 0, None, ss=st.ss)
    return F.linear(st.h, m.lm_head)  # bf16: fused_sample reads it as fp32, as .float() would


def sample_next(st: _State, logits: Tensor, greedy: bool, filters: Filters) -> None:
    """Sample every row's next token from `logits` and advance: in one fused pass
    (`sampling.fused_sample`, keyed by st.seed and st.step; top-k and min-p as a threshold per row)
    unless top-p needs a sort."""
    min_p = st.min_p if filters.min_p else None
    if greedy or not filters.top_p:
        keep = keep_threshold(logits, st.temperature, filters.top_k, min_p) if filters.top_k or filters.min_p else None
        drawn = fused_sample(logits, st.temperature, st.seed, st.step, greedy, keep=keep)
    else:
        drawn = sample(logits, st.temperature, st.top_p, greedy, True, st.generator, top_k=filters.top_k, min_p=min_p)
    _advance(st, *drawn)


def _advance(st: _State, tok: Tensor, lp: Tensor, ent: Tensor) -> None:
    # record this step's outputs, apply EOS stopping, move every sequence one slot on
    live = ~st.done
    tok = torch.where(live, tok, st.pad_id)
    st.out_tok.index_copy_(1, st.step, tok[:, None])
    st.out_mask.index_copy_(1, st.step, live[:, None])
    st.out_lp.index_copy_(1, st.step, (lp * live)[:, None])
    st.out_ent.index_copy_(1, st.step, (ent * live)[:, None])
    st.done |= (tok[:, None] == st.eos).any(dim=1)
    st.tok.copy_(tok)
    st.step += 1
    st.slot += 1
    st.pos += 1


def decode_one_token(m: _Model, cache: _Cache, st: _State, greedy: bool, filters: Filters) -> None:
    """One decode step for every sequence: forward st.tok, sample, record, advance (captured)."""
    sample_next(st, _forward(m, cache, st), greedy, filters)


def decode_n_tokens(step, st: _State, n: int, check_every: int = 16) -> int:
    """Run `step()` n times, stopping early (checked every `check_every` steps) once all are done."""
    for i in range(n):
        step()
        if (i + 1) % check_every == 0 and bool(st.done.all()):
            return i + 1
    return n
