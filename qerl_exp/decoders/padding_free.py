"""The padding-free pass: the decoder run by hand over a packed micro-batch (`qerl_exp.decoders.packing`),
to the final-norm hidden states at the scored positions (`train.padding_free`).

It replaces the padded path's HF forward through peft (`scoring.score_completions`):
- **The decoder**: the HF model's own parameters (so optimizer, checkpoints and AQN are untouched),
  read through `qerl_exp.decoders.blocks` (the architectures it declares; any other is refused there) and
  run by hand. Attention is FlashAttention over variable-length sequences on CUDA, the packing's
  block mask elsewhere. RMSNorm (with the residual add before it), RoPE and SwiGLU are one
  hand-fused Triton launch each way on CUDA (`qerl_exp.decoders.elementwise`, `train.fused_ops`); each
  projection group (q/k/v, o, gate/up, down) is one base product with its LoRA term added in the
  same GEMM's epilogue (`_LoraLinear`), and 4-bit bases are decoded for that product and again in
  backward, never kept. Checkpointed blocks run without autograd in forward and again under it in
  backward (`_Recomputed`).
- **Its memory**: `gradient_checkpointing=auto` recomputes the fewest decoder blocks that let the
  micro-batch's activations fit in the free device memory (`checkpointed_layers`, from the block
  shapes `blocks.read` gives).

`scoring.score_packed` packs, runs this pass and applies the LM head.
"""

from __future__ import annotations

import contextlib
import functools
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from qerl_exp.decoders import blocks
from qerl_exp.decoders.packing import Pack, block_mask


# ---------------------------------------------------------------------------------------------
# Attention over the packed sequences


class _FlashVarlen(torch.autograd.Function):
    """FlashAttention-2 over variable-length sequences (causal, aligned to each sequence's last key),
    forward and backward, with grouped-query heads as they are."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng, unused)
        ctx.max_q, ctx.max_k, ctx.scale = max_q, max_k, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_q, cu_k, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, ctx.max_q, ctx.max_k, 0.0, True, rng, unused,
            scale=ctx.scale)
        return dq, dk, dv, None, None, None, None, None


def uses_flash(q: torch.Tensor) -> bool:
    """FlashAttention on CUDA for fp16/bf16 heads of at most 256; the dense block mask otherwise."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: Pack, scale: float, mask: torch.Tensor | None):
    """Attention `[N, Hq, D]` of packed queries over their sequences' keys (`[N, Hkv, D]`): with
    FlashAttention when `mask` is None, else SDPA under `mask` (`packing.block_mask(p)`)."""
    if mask is None:
        k, v = (k.index_select(0, p.kv_index), v.index_select(0, p.kv_index)) if p.gather else (k.contiguous(), v.contiguous())
        return _FlashVarlen.apply(q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k, scale)
    rep = q.shape[1] // k.shape[1]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)[0].transpose(0, 1)


# ---------------------------------------------------------------------------------------------
# The elementwise pieces (torch definitions; hand-fused kernels on CUDA in `qerl_exp.decoders.elementwise`)


def _add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """`(x + delta, RMSNorm(x + delta))`: the residual add fused into the next norm."""
    x = x + delta
    return x, blocks.rms_norm(x, weight, eps)


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary embedding of `[N, H, D]` queries and keys; cos, sin `[N, D]` (HF's rotate_half form)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    return rotate(q), rotate(k)


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _elementwise(fused: bool):
    """`(rms_norm, add_rms_norm, rope, swiglu)`: the Triton kernels of `qerl_exp.decoders.elementwise` when
    `fused` (CUDA), else the torch definitions above."""
    if not fused:
        return blocks.rms_norm, _add_rms_norm, _rope, _swiglu
    from qerl_exp.decoders import elementwise  # needs Triton: imported on CUDA only

    return elementwise.rms_norm, elementwise.add_rms_norm, elementwise.rope, elementwise.swiglu


# ---------------------------------------------------------------------------------------------
# One launch per projection group: base product + LoRA


_stacks: dict | None = None  # inside `same_adapters()`: each group's stacked A and B, by (first A, dtype)


@contextlib.contextmanager
def same_adapters():
    """A span in which the adapters do not change (one optimizer step's micro-batches): each group's
    A and B are stacked and cast once in it, not at every pass of every micro-batch."""
    global _stacks
    outer, _stacks = _stacks, {}
    try:
        yield
    finally:
        _stacks = outer


def _stack(a_list, b_list, scales: list[float], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`(A, B)`: the adapters' A stacked `[R, K]`, B block-diagonal with its scales `[O, R]`, in `dtype`
    (a zero-rank adapter, `blocks`' of a projection without one, adds no rows and no columns)."""
    key = (*(id(a) for a in a_list if a.shape[0]), dtype)  # the parameters: a zero-rank A is made at each read
    if _stacks is not None and key in _stacks:
        return _stacks[key]
    with torch.no_grad():
        a = torch.cat(a_list).to(dtype) if len(a_list) > 1 else a_list[0].to(dtype)
        b = torch.block_diag(*[bi * s for bi, s in zip(b_list, scales)]).to(dtype)
    if _stacks is not None:
        _stacks[key] = a, b
    return a, b


def _lora_product(x, base: blocks.Group, scales: list[float], xa, a_list, b_list):
    """`(y, lora_in, t, a, b)`: the group's output and what its backward needs (see `_LoraLinear`)."""
    a, b = _stack(a_list, b_list, scales, x.dtype)
    w, bias = base.base_weight(x.dtype), base.bias(x.dtype)
    lora_in = x if xa is None else xa
    t = lora_in @ a.t()  # [N, R]
    c = torch.addmm(bias, t, b.t()) if bias is not None else t @ b.t()
    return torch.addmm(c, x, w.t()), lora_in, t, a, b


class _LoraLinear(torch.autograd.Function):
    """`x @ W^T + bias + sum_i s_i (xa @ A_i^T) @ B_i^T` (each adapter's output in its own columns) in
    one base GEMM whose epilogue adds the LoRA term.

    W (the group's frozen base, stacked) is fetched from `base` in forward and again in backward, so
    autograd keeps only `x` (for A's gradient) and the `[N, R]` LoRA activations. The adapters'
    A `[r_i, K]` and B `[O_i, r_i]` come as they are (fp32 parameters): they are stacked, B
    block-diagonally with its scale, and cast inside, and their gradients split back, so that a
    group costs one autograd node, not one per cast and stack. `xa` is the adapters' input (x after
    LoRA dropout); None: x itself.
    """

    @staticmethod
    def forward(ctx, x, base, scales, xa, *ab):
        n = len(scales)
        a_list, b_list = ab[:n], ab[n:]
        y, lora_in, t, a, b = _lora_product(x, base, scales, xa, a_list, b_list)
        ctx.base, ctx.dropout, ctx.scales = base, xa is not None, scales
        ctx.ranks, ctx.outs = [ai.shape[0] for ai in a_list], [bi.shape[0] for bi in b_list]
        ctx.save_for_backward(lora_in, t, a, b)
        return y

    @staticmethod
    def backward(ctx, gy):
        lora_in, t, a, b = ctx.saved_tensors
        g = gy @ b  # [N, R]
        gx = gxa = None
        if ctx.needs_input_grad[0]:
            w = ctx.base.base_weight(gy.dtype)
            if ctx.dropout:
                gx, gxa = gy @ w, g @ a
            else:
                gx = torch.addmm(g @ a, gy, w)
        ga = (g.t() @ lora_in).split(ctx.ranks)
        gb_full = gy.t() @ t  # [O, R]: the diagonal blocks are B's gradients (times their scales)
        gb, r0 = [], 0
        for rows, r, o0, s in zip(ctx.outs, ctx.ranks, [0, *itertools.accumulate(ctx.outs)], ctx.scales):
            gb.append(gb_full[o0 : o0 + rows, r0 : r0 + r] * s)
            r0 += r
        return (gx, None, None, gxa, *ga, *gb)


def _frozen_linear(x: torch.Tensor, base: blocks.Group) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return F.linear(x, base.base_weight(x.dtype), base.bias(x.dtype))
    return _FrozenGroup.apply(x, base)


class _FrozenGroup(torch.autograd.Function):
    """A projection group without adapters (or with them disabled): `x @ W^T + bias`, W never saved."""

    @staticmethod
    def forward(ctx, x, base):
        ctx.base = base
        return F.linear(x, base.base_weight(x.dtype), base.bias(x.dtype))

    @staticmethod
    def backward(ctx, gy):
        return (gy @ ctx.base.base_weight(gy.dtype) if ctx.needs_input_grad[0] else None), None


def _group(group: blocks.Group, x: torch.Tensor) -> torch.Tensor:
    """One projection group (its projections' outputs side by side) on `x`."""
    if group.adapters is None:
        return _frozen_linear(x, group)
    dropout = next(a.dropout for a in group.adapters if a.a.shape[0])  # one config a group (zero-rank ones: none)
    xa = dropout(x) if not isinstance(dropout, nn.Identity) and dropout.training else None
    scales = [a.scale for a in group.adapters]
    a_list, b_list = [a.a for a in group.adapters], [a.b for a in group.adapters]
    if not torch.is_grad_enabled():  # a forward without backward (old or reference log-probs, a checkpointed block)
        return _lora_product(x, group, scales, xa, a_list, b_list)[0]
    return _LoraLinear.apply(x, group, scales, xa, *a_list, *b_list)


# ---------------------------------------------------------------------------------------------
# The decoder pass


def _block(blk: blocks.Block, x, delta, cos, sin, p: Pack, mask, fused: bool):
    """One decoder block on the residual stream `x + delta`; returns the next `(x, delta)` (the
    residual add is left to the next norm, which it is fused into)."""
    norm, add_norm, rope, swiglu = _elementwise(fused)
    n, d = x.shape[0], blk.head_dim
    if delta is None:  # the first block: x is the embedding
        h = norm(x, blk.attention_norm, blk.eps)
    else:
        x, h = add_norm(x, delta, blk.attention_norm, blk.eps)
    q, k, v = _group(blk.qkv, h).split([blk.heads * d, blk.kv_heads * d, blk.kv_heads * d], dim=-1)
    if blk.q_norm is not None:  # per head, before RoPE
        q = norm(q.reshape(n * blk.heads, d), blk.q_norm, blk.eps)
        k = norm(k.reshape(n * blk.kv_heads, d), blk.k_norm, blk.eps)
    q, k = rope(q.reshape(n, blk.heads, d), k.reshape(n, blk.kv_heads, d), cos, sin)
    a = attend(q, k, v.reshape(n, blk.kv_heads, d), p, blk.scaling, mask).reshape(n, blk.heads * d)
    x, h = add_norm(x, _group(blk.o, a), blk.mlp_norm, blk.eps)
    return x, _group(blk.down, swiglu(_group(blk.gate_up, h)))


class _Recomputed(torch.autograd.Function):
    """A checkpointed decoder block: forward runs it without autograd and keeps only its inputs;
    backward runs it again under autograd (the random state restored, so a LoRA dropout draws the
    same mask) and back-propagates through that. Lighter on the host than `torch.utils.checkpoint`,
    whose forward records the graph and passes every saved tensor through hooks.

    `run(x, delta) -> (x, delta)` is the block; `params` are its trainable parameters, inputs here so
    that their gradients flow back through this node.
    """

    @staticmethod
    def forward(ctx, run, x, delta, *params):
        ctx.run, ctx.params = run, params
        ctx.rng = torch.get_rng_state(), (torch.cuda.get_rng_state(x.device) if x.is_cuda else None)
        ctx.save_for_backward(x, delta)
        return run(x, delta)

    @staticmethod
    def backward(ctx, gx, gdelta):
        x, delta = ctx.saved_tensors
        cpu_state, cuda_state = ctx.rng
        now = torch.get_rng_state(), (torch.cuda.get_rng_state(x.device) if x.is_cuda else None)
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, x.device)
        with torch.enable_grad():
            xi = x.detach().requires_grad_(ctx.needs_input_grad[1])
            di = None if delta is None else delta.detach().requires_grad_(ctx.needs_input_grad[2])
            outs = ctx.run(xi, di)
        torch.set_rng_state(now[0])
        if now[1] is not None:
            torch.cuda.set_rng_state(now[1], x.device)
        wrt = [t for t in (xi, di, *ctx.params) if t is not None and t.requires_grad]
        used = [(o, g) for o, g in zip(outs, (gx, gdelta)) if g is not None]
        grads = iter(torch.autograd.grad([o for o, _ in used], wrt, [g for _, g in used], allow_unused=True))
        return (None, *[next(grads) if t is not None and t.requires_grad else None for t in (xi, di, *ctx.params)])


def hidden_states(dec: blocks.Decoder, p: Pack, checkpointed: int = 0, fused: bool = False) -> torch.Tensor:
    """Final-norm hidden states `[M, H]` at the scored positions (`p.predict`).

    Args:
        dec: the model read by `blocks.read` (with its adapters, or without: the reference policy).
        p: the packed micro-batch.
        checkpointed: decoder blocks (the first ones) recomputed in backward instead of kept.
        fused: use the hand-fused elementwise kernels (CUDA).
    """
    x = F.embedding(p.input_ids, dec.embed)
    cos, sin = dec.rotary(x.unsqueeze(0), p.position_ids.unsqueeze(0))
    cos, sin = cos[0], sin[0]
    mask = None if uses_flash(x.new_empty(1, 1, dec.head_dim)) else block_mask(p)
    delta = None
    for i, blk in enumerate(dec.blocks):
        if i < checkpointed and torch.is_grad_enabled():
            if delta is not None:  # the residual sum: one saved input instead of two
                x, delta = x + delta, None
            run = functools.partial(_block, blk, cos=cos, sin=sin, p=p, mask=mask, fused=fused)
            x, delta = _Recomputed.apply(run, x, delta, *blk.trainable())
        else:
            x, delta = _block(blk, x, delta, cos, sin, p, mask, fused)
    x, delta = x.index_select(0, p.predict), delta.index_select(0, p.predict)
    return _elementwise(fused)[1](x, delta, dec.norm, dec.eps)[1]


def activation_bytes(dec: blocks.Decoder, tokens: int, dtype: torch.dtype) -> tuple[int, int]:
    """What backward keeps per decoder block for `tokens` packed tokens: `(kept, checkpointed)`
    bytes, from the block's shapes (an estimate: the block's saved inputs, projections and
    attention statistics; the shared-prompt key copies counted at their most, two per token)."""
    blk = dec.blocks[0]
    h, inter = dec.embed.shape[1], blk.gate_up.out_features[0]
    q, kv = dec.heads * dec.head_dim, dec.kv_heads * dec.head_dim
    size = torch.finfo(dtype).bits // 8
    kept = tokens * (size * (4 * h + 2 * q + 4 * kv + 3 * inter) + 4 * (dec.heads + 2))
    return kept, tokens * size * h


def checkpointed_layers(dec: blocks.Decoder, tokens: int, dtype: torch.dtype, device: torch.device,
                        setting: str) -> int:
    """How many decoder blocks to recompute for a micro-batch of `tokens`: all (`true`), none
    (`false`), or with `auto` the fewest that fit its activations in 80 % of the device memory free
    now (CUDA; none elsewhere)."""
    layers = len(dec.blocks)
    if setting != "auto":
        return layers if setting == "true" else 0
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    kept, saved = activation_bytes(dec, tokens, dtype)
    budget = 0.8 * free
    for k in range(layers + 1):
        if (layers - k) * kept + k * saved + kept <= budget:  # + one block recomputed in backward
            return k
    return layers
