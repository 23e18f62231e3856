"""The one tensor reader of a decoder: a (peft-wrapped) HF causal LM of a declared architecture
(`qerl_exp.config.architectures`) read into what both hand-written decoder passes compute with, and the
guard that they compute the model the sampler samples from.

Two decoders run the policy besides HF's own forward: the rollout engine (`qerl_exp.engine`) and
the padding-free learner (`qerl_exp.decoders.padding_free`). Both read the model through `read`, so they
agree on which tensors make a block and how its projections are grouped, and both refuse a model
whose family is not declared or whose variant they do not compute (HF's forward through peft,
`train.padding_free=false rollout.engine=hf`, runs those).

Every declared architecture is the Llama block (`qerl_exp.config.architectures` says what each family adds,
where its pre-norms are, which variants it refuses). Adding a family is one `Architecture` entry,
plus code in both decoders only where it computes something new (as Qwen3's per-head q/k norm did).

Projections that read the same input form one group (q|k|v, o, gate|up, down): one product each
in both decoders. A group's dense base weights may lie end to end in one buffer (`stack_dense`,
which the engine calls so that cuBLAS multiplies q, k and v in one GEMM); `Group.base_weight` then
views that buffer instead of copying the three matrices, and this module is the one that knows it.

Before step 0 a run compares the sampler's log-probs of a short rollout with the learner's
(`check_agreement`): two decoders of one model differ by rounding only, below `DECODER_GAP`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qerl_exp.config.architectures import (FALLBACK, PROJECTIONS, Architecture, UnsupportedModel, architecture, body,
                                           causal_lm, final_norm, layers)
from qerl_exp.quant import base_weight, stacked_base_weight


@dataclass
class Adapter:
    """One projection's LoRA adapter, as peft holds it: `y += scale * B(A(dropout(x)))`.

    Args:
        a: the A parameter `[r, in]`. b: the B parameter `[out, r]`.
        scale: alpha / r. dropout: the adapter input's dropout module (`nn.Identity` when none).
    """

    a: Tensor
    b: Tensor
    scale: float
    dropout: nn.Module


@dataclass
class Group:
    """Projections fed one input, run as one product whose output columns are theirs in order.

    Args:
        bases: the frozen base layers (`nn.Linear`, or a weight format's linear from `qerl_exp.quant`).
        adapters: per base its `Adapter`; None when no projection of the group applies one (no LoRA,
            or the adapters disabled). Where some do (`lora.targets` names part of a group), each of
            the others holds a zero-rank one (`A [0, in]`, `B [out, 0]`), which adds nothing.
    """

    bases: list[nn.Module]
    adapters: list[Adapter] | None

    @property
    def out_features(self) -> list[int]:
        return [m.out_features for m in self.bases]

    def base_weight(self, dtype: torch.dtype) -> Tensor:
        """The group's frozen weight `[sum of out, in]` in `dtype`: a view when its dense weights lie
        stacked in one buffer (`stack_dense`), else built anew (4-bit formats decoded into it)."""
        if len(self.bases) == 1:
            return base_weight(self.bases[0], dtype)
        dense = [m.weight for m in self.bases if type(m) is nn.Linear and m.weight.dtype == dtype]
        if len(dense) == len(self.bases) and _adjacent(dense):
            first = dense[0]
            return first.as_strided((sum(w.shape[0] for w in dense), first.shape[1]), (first.shape[1], 1))
        return stacked_base_weight(self.bases, dtype)

    def bias(self, dtype: torch.dtype) -> Tensor | None:
        """The group's bias `[sum of out]` (zeros for projections without one), or None when none has one."""
        biases = [getattr(m, "bias", None) for m in self.bases]
        if all(b is None for b in biases):
            return None
        return torch.cat([torch.zeros(m.out_features, dtype=dtype, device=m.weight.device) if b is None else b.to(dtype)
                          for b, m in zip(biases, self.bases)])


@dataclass
class Block:
    """One decoder block: its pre-norm scales (the tensors AQN perturbs in place), its projection
    groups and its attention shape.

    Args:
        attention_norm: the RMSNorm scale before attention `[H]` (`Architecture.attention_norm`).
        mlp_norm: the RMSNorm scale before the MLP `[H]` (`Architecture.mlp_norm`).
        q_norm, k_norm: per-head RMSNorm scales `[head_dim]` (`Architecture.qk_norm`), else None.
        eps: the block's norms' epsilon.
        qkv, o, gate_up, down: the projection groups.
        heads, kv_heads, head_dim: the attention shape. scaling: the softmax scale.
    """

    attention_norm: Tensor
    mlp_norm: Tensor
    q_norm: Tensor | None
    k_norm: Tensor | None
    eps: float
    qkv: Group
    o: Group
    gate_up: Group
    down: Group
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float

    @property
    def groups(self) -> dict[str, Group]:
        return {"qkv": self.qkv, "o": self.o, "gate_up": self.gate_up, "down": self.down}

    def trainable(self) -> list[Tensor]:
        """The block's tensors that take gradients: its adapters' A and B."""
        return [t for g in self.groups.values() for a in g.adapters or [] for t in (a.a, a.b) if t.requires_grad]


@dataclass
class Decoder:
    """A causal LM as both decoders compute it.

    Args:
        arch: its declared architecture.
        embed: the token embedding `[V, H]`. blocks: the decoder blocks. norm: the final norm's
            scale. eps: its epsilon. lm_head: the output layer (its base layer, no adapter).
        rotary: HF's rotary embedding module (`rotary(x, position_ids) -> (cos, sin)`).
        heads, kv_heads, head_dim, scaling: the attention shape, one for every block (`read` refuses
            a model whose blocks differ): the KV cache's and the rotary tables'.
        config: the HF model config.
    """

    arch: Architecture
    embed: Tensor
    blocks: list[Block]
    norm: Tensor
    eps: float
    lm_head: nn.Module
    rotary: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    config: object


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as every declared architecture computes it, rounded where HF rounds: in fp32, the
    normalised value cast to x's dtype, then times the scale (the torch definition both decoders'
    kernels are held to)."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _is_lora(module: nn.Module) -> bool:
    # peft's LoRA layers, recognized by what they hold (peft itself is imported only where adapters are made)
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def _adapter(module: nn.Module, use: bool) -> tuple[nn.Module, Adapter | None]:
    """(base layer, its active adapter or None) of one projection."""
    if not _is_lora(module):
        return module, None
    base = module.get_base_layer()
    active = [] if not use or module.disable_adapters else [a for a in module.active_adapters if a in module.lora_A]
    if not active:
        return base, None
    if len(active) > 1:
        raise UnsupportedModel(f"{len(active)} active adapters ({', '.join(active)}); the decoders apply one; "
                               f"set {FALLBACK}")
    name = active[0]
    if getattr(module, "merged", False) or getattr(module, "use_dora", {}).get(name, False):
        raise UnsupportedModel(f"a merged or DoRA adapter ({name}); the decoders apply unmerged LoRA; set {FALLBACK}")
    return base, Adapter(module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name]),
                         module.lora_dropout[name])


def _group(modules: list[nn.Module], use_adapters: bool) -> Group:
    read = [_adapter(m, use_adapters) for m in modules]
    adapters = [a for _, a in read]
    if all(a is None for a in adapters):
        return Group([b for b, _ in read], None)
    like = next(a for a in adapters if a is not None)
    return Group([b for b, _ in read], [a if a is not None else _zero_rank(b, like) for b, a in read])


def _zero_rank(base: nn.Module, like: Adapter) -> Adapter:
    """The adapter of a projection without one, in a group where others have one: rank 0."""
    return Adapter(like.a.new_zeros(0, base.in_features), like.b.new_zeros(base.out_features, 0), 0.0, nn.Identity())


def _block(layer: nn.Module, arch: Architecture, adapters: bool) -> Block:
    attn, norm = layer.self_attn, getattr(layer, arch.attention_norm)
    d = attn.head_dim

    def group(*names: str) -> Group:
        return _group([layer.get_submodule(PROJECTIONS[n]) for n in names], adapters)

    qkv = group("q_proj", "k_proj", "v_proj")
    return Block(
        attention_norm=norm.weight, mlp_norm=getattr(layer, arch.mlp_norm).weight,
        q_norm=attn.q_norm.weight if arch.qk_norm else None, k_norm=attn.k_norm.weight if arch.qk_norm else None,
        eps=float(norm.variance_epsilon), qkv=qkv, o=group("o_proj"), gate_up=group("gate_proj", "up_proj"),
        down=group("down_proj"), heads=qkv.out_features[0] // d, kv_heads=qkv.out_features[1] // d, head_dim=d,
        scaling=float(getattr(attn, "scaling", d ** -0.5)),
    )


def read(model: nn.Module, adapters: bool = True) -> Decoder:
    """The decoder of `model`, its tensors the model's own (nothing is copied).

    Args:
        model: an HF causal LM of a declared architecture, or a peft model around one.
        adapters: read the active LoRA adapters (False: the base alone, the reference policy).

    Raises:
        UnsupportedModel: the architecture is not declared or its variant not computed
            (`architectures.architecture`), its blocks differ in attention shape, or its adapters
            are not the plain unmerged LoRA both decoders apply.
    """
    lm = causal_lm(model)
    arch = architecture(lm.config)
    blocks = [_block(layer, arch, adapters) for layer in layers(lm)]
    shapes = {(b.heads, b.kv_heads, b.head_dim, b.scaling) for b in blocks}
    if len(shapes) != 1:
        raise UnsupportedModel(f"{arch.model_type} with blocks of different attention shapes ({sorted(shapes)}); "
                               f"the decoders keep one KV cache shape; set {FALLBACK}")
    heads, kv_heads, head_dim, scaling = shapes.pop()
    head, head_adapter = _adapter(lm.lm_head, adapters)
    if head_adapter is not None:
        raise UnsupportedModel(f"LoRA on lm_head; the decoders apply adapters inside the blocks; set {FALLBACK}")
    inner, norm = body(lm), final_norm(lm)
    return Decoder(arch=arch, embed=inner.embed_tokens.weight, blocks=blocks, norm=norm.weight,
                   eps=float(norm.variance_epsilon), lm_head=head, rotary=inner.rotary_emb, heads=heads,
                   kv_heads=kv_heads, head_dim=head_dim, scaling=scaling, config=lm.config)


def _adjacent(ws: list[Tensor]) -> bool:
    """The matrices lie end to end in one buffer, row-major, in this order (`stack_dense` put them so)."""
    storage = ws[0].untyped_storage().data_ptr()
    return all(w.is_contiguous() and w.untyped_storage().data_ptr() == storage and w.shape[1] == ws[0].shape[1]
               for w in ws) and all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in zip(ws, ws[1:]))


def stack_dense(group: Group) -> Tensor:
    """The group's dense base weights as one `[sum of out, in]` tensor, their parameters re-pointed
    to its row blocks (`p.data = ...`), so the values stay stored once and `Group.base_weight` views
    them; weights already stacked (by an earlier call) are viewed, not copied again.

    The rollout engine calls it, so that cuBLAS multiplies a group in one GEMM; the parameters are
    frozen, so nothing but their addresses changes.
    """
    weights = [m.weight for m in group.bases]
    first = weights[0]
    if len(weights) == 1:
        return first
    rows = sum(w.shape[0] for w in weights)
    if _adjacent(weights):
        return first.detach().as_strided((rows, first.shape[1]), (first.shape[1], 1))
    stacked = torch.cat([w.detach() for w in weights])
    row = 0
    for w in weights:
        w.data = stacked[row: row + w.shape[0]]
        row += w.shape[0]
    return stacked


class DecoderMismatch(RuntimeError):
    """The sampler and the learner compute different models (`check_agreement`)."""


# How far the sampler's and the learner's log-probs of the same tokens may lie apart (token mean of
# |difference|, nats) when both compute one model: rounding, by the model's dtype. The rounding gap
# grows with how peaked the model's next-token distributions are: measured in bf16, 2e-4 to 7e-4
# on HF-initialised tiny checkpoints (nearly uniform, about log V nats a token), 0.003 to 0.012 on
# the same with their LM head scaled to a trained model's peakedness (about 1 nat a token), 0.030
# for SmolLM2-135M on the CPU and 0.036 to 0.045 on an H200 (the engine against the learner); in
# float32 at most 4e-6. Qwen3 read without its q/k norms (the defect this guard was built for) lies
# at 1.56 to 1.67 on those peaked checkpoints in either dtype: 6x above the bf16 bound, which is 5.5x
# above the largest rounding gap measured. On HF-initialised checkpoints that defect gives only 0.05
# to 0.07 (float32 catches it, bf16 cannot: no model that samples near uniformly moves far).
# float16 rounds finer than bf16 and keeps bf16's bound.
DECODER_GAP = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.25}


def logp_gap(sampler_logp: Tensor, learner_logp: Tensor, mask: Tensor) -> float:
    """The token mean of |sampler - learner| log-probs `[B, T]` over the tokens of `mask` (0: none)."""
    on = mask.bool()
    return float((sampler_logp - learner_logp).abs()[on].mean()) if on.any() else 0.0


def check_agreement(model: nn.Module, gap: float, any_rank: Callable[[bool], bool] = bool) -> None:
    """Stop unless the sampler's and the learner's log-probs of one rollout (`logp_gap`) agree to
    rounding in the model's dtype (`DECODER_GAP`).

    Args:
        model: the policy both decoded.
        gap: their `logp_gap`.
        any_rank: whether a condition holds on any rank of a data-parallel run (`distributed.any_rank`).

    Raises:
        DecoderMismatch: one line naming the architecture, the gap, its bound and the fallback settings.
    """
    lm = causal_lm(model)
    limit = DECODER_GAP.get(lm.get_input_embeddings().weight.dtype, DECODER_GAP[torch.bfloat16])
    if any_rank(gap > limit):
        raise DecoderMismatch(
            f"the sampler's and the learner's log-probs of the same tokens differ by {gap:.3g} nats a token before "
            f"step 0 (rounding allows {limit:g}): they compute different models for {lm.config.model_type} "
            f"({type(lm).__name__}); set {FALLBACK}")
