"""The decode path of `FastEngine` (`fast_engine`): gpt-fast style rollouts for the causal LMs
`qerl_exp.decoders.blocks` declares (Llama, Qwen2, Qwen3), as free functions.

A static KV cache (`setup_caches`), a `prefill()`, and a `decode_one_token()` step (forward,
sampling on the device, per-sequence EOS bookkeeping) that `FastEngine` captures once per batch
size in a CUDA graph and replays `max_new_tokens - 1` times (`decode_n_tokens`).

The engine reads the model through `blocks.read`. Its Triton kernels read tensors through address
tables: the model's frozen ones in place (dense base weights, stacked one group a buffer by
`blocks.stack_dense`; embeddings, lm_head), and its own copies of what changes between rollouts
(LoRA A/B after an optimizer step, norm scales with AQN's noise in them), which `refresh` brings up
to date at the start of every `generate`, so a replay needs no recapture. `FP4Linear` bases
(NVFP4/MXFP4) convert themselves to the kernels' layout (`layout.KernelWeight`) and the learner
decodes from it too: one copy. bitsandbytes NF4 `Linear4bit` bases are re-laid out once, at build
time, into a second copy (`FastEngine.nbytes` counts it with the KV cache). LoRA is applied
unmerged: `y = base(x) + (x @ A^T) @ B^T * scaling`. If a frozen tensor is re-allocated
(`p.data = ...`) or a layer replaced, the next `generate` notices and rebuilds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qerl_exp.decoders import blocks
from qerl_exp.engine.attention import attention_workspace, decode_attention
from qerl_exp.engine.linear import LinearPlan, fused_linear
from qerl_exp.engine.norm import norm_shrink
from qerl_exp.engine.rope_cache import rope_cache
from qerl_exp.engine.sampling import Filters, fused_sample, keep_threshold, sample
from qerl_exp.quant import is_quantized

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
# The model as the engine sees it: references to its frozen tensors, copies of the changing ones
# ---------------------------------------------------------------------------------------------


@dataclass
class LinearGroup:
    """1-3 projections sharing one input (q/k/v; gate/up as GLU; o; down), as one launch."""

    fmt: str
    weights: list  # Tensor (the model's own dense weight) or layout.KernelWeight
    biases: list
    lora_a: list | None  # the engine's copy of each projection's LoRA A [r, K]
    lora_b: list | None  # ... and B [N, r]
    scale: list
    r: int  # the group's rank: its largest adapter's; a smaller one (0: no adapter) is zero-padded to it
    ranks: list  # each projection's own rank
    glu: bool
    bases: list  # the base layers the weights were read from (an in-place requantize_ is seen)
    updates: list  # each base layer's `updates` count when read (None: not an FP4Linear)
    stacked: Tensor | None  # dense: the weights as one [sum of N, K] tensor (`blocks.stack_dense`)
    plan: LinearPlan | None = None
    a_tab: Tensor | None = None


@dataclass
class Layer:
    """One decoder block as the engine runs it (`blocks.Block` read by `build_model`)."""

    ln1: Tensor  # the engine's copies of the pre-norm scales (before attention, before the MLP)
    ln2: Tensor
    eps: float  # their epsilon
    q_norm: Tensor | None  # Qwen3's per-head q/k norm scales [d], else None
    k_norm: Tensor | None
    qkv: LinearGroup
    o: LinearGroup
    gate_up: LinearGroup
    down: LinearGroup


@dataclass
class Model:
    """The model as the engine runs it (`build_model`): what prefill and the decode step read."""

    embed: Tensor
    norm: Tensor  # the engine's copy of the final norm's scale
    lm_head: Tensor
    layers: list
    eps: float  # the final norm's epsilon
    hq: int  # the attention shape, one for every block (`blocks.Decoder`)
    hkv: int
    d: int
    scaling: float
    cos: Tensor  # [S, d]
    sin: Tensor


def _base_weight(base: nn.Module):
    """(format, weight, bias): a dense layer's own weight, or a weight format's layer's weight in
    the kernel layout (`QuantizedLinear.runtime_weight`: an `FP4Linear` on CUDA converts itself to
    it, so the engine holds no second copy; NF4 is laid out again, a copy counted by `FastEngine.nbytes`)."""
    if type(base) is nn.Linear:
        return "dense", base.weight, base.bias
    if not is_quantized(base):
        raise TypeError(f"the rollout engine has no kernels for a {type(base).__name__} projection; "
                        "set rollout.engine=hf")
    w = base.runtime_weight()
    return w.fmt, w, base.bias


def _copy(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().clone()


def _linear(group: blocks.Group, glu: bool = False) -> LinearGroup:
    stacked = None
    if all(type(b) is nn.Linear for b in group.bases):  # stacked by every engine, so that none re-points what another read
        stacked = blocks.stack_dense(group)
    parts = [_base_weight(b) for b in group.bases]
    fmts = {fmt for fmt, _, _ in parts}
    if len(fmts) != 1:
        raise NotImplementedError(f"mixed weight formats in one projection group: {sorted(fmts)}")
    lora_a = lora_b = None
    scale, r, ranks = [0.0] * len(parts), 0, [0] * len(parts)
    if group.adapters is not None:
        # the kernels take one rank a group: a projection of a lower one (0: without an adapter, `blocks`)
        # gets zero rows of A and zero columns of B up to the largest, which add nothing
        ranks = [a.a.shape[0] for a in group.adapters]
        r = max(ranks)
        lora_a = [a.a.new_zeros(r, a.a.shape[1]) for a in group.adapters]
        lora_b = [a.b.new_zeros(a.b.shape[0], r) for a in group.adapters]
        _copy_adapters(lora_a, lora_b, group)
        scale = [a.scale for a in group.adapters]
    return LinearGroup(fmts.pop(), [w for _, w, _ in parts], [b for _, _, b in parts], lora_a, lora_b, scale, r, ranks,
                       glu, list(group.bases), [getattr(b, "updates", None) for b in group.bases], stacked)


def _copy_adapters(lora_a: list[Tensor], lora_b: list[Tensor], group: blocks.Group) -> None:
    """The group's adapters into the engine's (zero-padded) copies: A's first rows, B's first columns."""
    for a, b, adapter in zip(lora_a, lora_b, group.adapters):
        rank = adapter.a.shape[0]
        a[:rank].copy_(adapter.a)
        b[:, :rank].copy_(adapter.b)


def build_model(dec: blocks.Decoder, max_seq_len: int) -> Model:
    """The engine's view of a model read by `blocks.read`: references to its frozen tensors (dense
    base weights, embeddings, lm_head; 4-bit bases in the kernel layout), copies of what changes
    between rollouts (LoRA A/B, norm scales: `refresh` brings them up to date)."""
    layers = [Layer(ln1=_copy(b.attention_norm), ln2=_copy(b.mlp_norm), eps=b.eps, q_norm=_copy(b.q_norm),
                    k_norm=_copy(b.k_norm), **{name: _linear(g, glu=name == "gate_up") for name, g in b.groups.items()})
              for b in dec.blocks]
    pos = torch.arange(max_seq_len, device=dec.embed.device)[None]
    cos, sin = dec.rotary(dec.embed[:1][None], pos)
    return Model(
        embed=dec.embed, norm=_copy(dec.norm), lm_head=dec.lm_head.weight, layers=layers, eps=dec.eps,
        hq=dec.heads, hkv=dec.kv_heads, d=dec.head_dim, scaling=dec.scaling,
        cos=cos[0].contiguous(), sin=sin[0].contiguous(),
    )


def refresh(m: Model, dec: blocks.Decoder) -> None:
    """Copy what changes between rollouts from the model (`dec`, read now) into the engine's
    buffers: LoRA A and B (an optimizer step) and every norm scale (AQN's noise, added to the
    model's scales around a rollout)."""
    m.norm.copy_(dec.norm)
    for ly, blk in zip(m.layers, dec.blocks):
        ly.ln1.copy_(blk.attention_norm)
        ly.ln2.copy_(blk.mlp_norm)
        if ly.q_norm is not None:
            ly.q_norm.copy_(blk.q_norm)
            ly.k_norm.copy_(blk.k_norm)
        for lin, group in zip((ly.qkv, ly.o, ly.gate_up, ly.down), blk.groups.values()):
            if group.adapters is not None:
                _copy_adapters(lin.lora_a, lin.lora_b, group)


def frozen(m: Model) -> list[Tensor]:
    """The model's tensors the engine reads in place (its frozen ones): a re-allocated one means a rebuild."""
    out = [m.embed, m.lm_head]
    for ly in m.layers:
        for lin in (ly.qkv, ly.o, ly.gate_up, ly.down):
            out += [w for w in lin.weights if isinstance(w, Tensor)] + [b for b in lin.biases if b is not None]
    return out


def same_layout(m: Model, dec: blocks.Decoder) -> bool:
    """`dec` (the model read now) has the base layers and the adapters' presence and ranks the
    engine was built from: else it must be built again."""
    for ly, blk in zip(m.layers, dec.blocks):
        for lin, group in zip((ly.qkv, ly.o, ly.gate_up, ly.down), blk.groups.values()):
            if any(a is not b for a, b in zip(lin.bases, group.bases)) or (lin.lora_a is None) != (group.adapters is None):
                return False
            if group.adapters is not None and [a.a.shape[0] for a in group.adapters] != lin.ranks:
                return False
    return len(m.layers) == len(dec.blocks)


# ---------------------------------------------------------------------------------------------
# Caches and per-batch state
# ---------------------------------------------------------------------------------------------


@dataclass
class Cache:
    """The static KV cache (`setup_caches`), one slot per position of every sequence."""

    k: Tensor  # [L, B_max, hkv, S, d]
    v: Tensor


def setup_caches(m: Model, max_batch_size: int, max_seq_len: int, cache: Cache | None = None) -> Cache:
    """Allocate the static KV cache once; reuse `cache` when it is already large enough."""
    shape = (len(m.layers), max_batch_size, m.hkv, max_seq_len, m.d)
    if cache is not None and all(a >= b for a, b in zip(cache.k.shape, shape)):
        return cache
    kw = dict(dtype=m.embed.dtype, device=m.embed.device)
    return Cache(torch.zeros(shape, **kw), torch.zeros(shape, **kw))


class State:
    """Static per-batch-size buffers that the captured decode step reads and writes."""

    def __init__(self, m: Model, b: int, s: int, rt: int):
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


def qk_norm(ly: Layer) -> tuple[Tensor, Tensor, float] | None:
    """The layer's per-head q/k norm scales and epsilon (Qwen3), as `rope_cache` takes them."""
    return (ly.q_norm, ly.k_norm, ly.eps) if ly.q_norm is not None else None


def _forward(m: Model, cache: Cache, st: State) -> Tensor:
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
        fused_linear(ly.qkv.plan, x, qkv_out, t=t[0] if lora[0] else None, norm=(ly.ln1, ly.eps, st.ss),
                     shrink=ly.qkv.a_tab)
        rope_cache(qkv_out, m.cos, m.sin, st.pos, st.slot, st.q, cache.k[li], cache.v[li], m.hq, m.hkv, m.d,
                   qk_norm=qk_norm(ly))
        att = decode_attention(st.q, cache.k[li], cache.v[li], st.pad, st.slot, m.scaling, st.att, st.att_work)
        fused_linear(ly.o.plan, att, x, t=t[1] if lora[1] else None, shrink=ly.o.a_tab, residual=x, ss_out=st.ss)
        # where down takes nvfp4_wgmma, the GLU epilogue writes its operand (inter / 16 in fp16)
        down16 = ly.down.plan.takes_x16(b, x.device)
        inter = torch.empty(b, ly.gate_up.plan.n, dtype=torch.float16 if down16 else x.dtype, device=x.device)
        fused_linear(ly.gate_up.plan, x, inter, t=t[2] if lora[2] else None, norm=(ly.ln2, ly.eps, st.ss),
                     shrink=ly.gate_up.a_tab, a_next=ly.down.lora_a[0] if lora[3] else None,
                     t_next=t[3] if lora[3] else None, r_next=ly.down.r, out16=down16)
        fused_linear(ly.down.plan, inter, x, t=t[3] if lora[3] else None, residual=x, ss_out=st.ss, x16=down16)
    norm_shrink(x, m.norm, m.eps, st.h, None, 1, 0, None, ss=st.ss)
    return F.linear(st.h, m.lm_head)  # bf16: fused_sample reads it as fp32, as .float() would


def sample_next(st: State, logits: Tensor, greedy: bool, filters: Filters) -> None:
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


def _advance(st: State, tok: Tensor, lp: Tensor, ent: Tensor) -> None:
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


def decode_one_token(m: Model, cache: Cache, st: State, greedy: bool, filters: Filters) -> None:
    """One decode step for every sequence: forward st.tok, sample, record, advance (captured)."""
    sample_next(st, _forward(m, cache, st), greedy, filters)


def decode_n_tokens(step, st: State, n: int, check_every: int = 16) -> int:
    """Run `step()` n times, stopping early (checked every `check_every` steps) once all are done."""
    for i in range(n):
        step()
        if (i + 1) % check_every == 0 and bool(st.done.all()):
            return i + 1
    return n
