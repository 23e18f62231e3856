"""The one reader of a decoder: the architectures the harness runs by its own decoder passes, and a
(peft-wrapped) HF causal LM read into what both of those passes compute with.

Two decoders run the policy besides HF's own forward: the rollout engine (`qerl_exp.engine`) and
the padding-free learner (`qerl_exp.padding_free`). Both read the model through `read`, so they
agree on which tensors make a block and how its projections are grouped, and both refuse a model
whose architecture is not declared here (HF's forward through peft, `train.padding_free=false
rollout.engine=hf`, runs any causal LM).

Every declared architecture is the Llama block: RMSNorm before attention and before the MLP,
rotary position embeddings (HF's own `rotary_emb` computes the tables, so rope scaling is the
checkpoint's), grouped-query attention over all earlier tokens, a SiLU-gated MLP; each family says
what it adds. Adding a family is one `Architecture` entry, plus code in both decoders only where it
computes something new (as Qwen3's per-head q/k norm did).

Projections that read the same input form one group (q|k|v, o, gate|up, down): one product each
in both decoders. A group's dense base weights may lie end to end in one buffer (`stack_dense`,
which the engine calls so that cuBLAS multiplies q, k and v in one GEMM); `Group.base_weight` then
views that buffer instead of copying the three matrices, and this module is the one that knows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qerl_exp.quant import base_weight, stacked_base_weight

FALLBACK = "train.padding_free=false rollout.engine=hf"


@dataclass(frozen=True)
class Architecture:
    """A decoder family by its HF `model_type`, and what its block adds to the Llama block.

    Args:
        model_type: the checkpoint config's `model_type`.
        qk_norm: an RMSNorm over each head's dims of q and k (`self_attn.q_norm`, `k_norm`), after
            the projections and before RoPE.
    """

    model_type: str
    qk_norm: bool = False


ARCHITECTURES = {a.model_type: a for a in (
    Architecture("llama"),  # Llama 2/3, SmolLM2, the embedded model with model.family=llama
    Architecture("qwen2"),  # Qwen2/2.5 (q/k/v bias), the embedded model's default family
    Architecture("qwen3", qk_norm=True),
)}


class UnsupportedModel(ValueError):
    """A model neither decoder of the harness computes; the message names the fallback."""


def architecture(config) -> Architecture:
    """The declared architecture of an HF model config.

    Raises:
        UnsupportedModel: one line naming the model type and the fallback settings, for a family
            that is not declared or a declared one with a variant neither decoder computes
            (another MLP activation, a biased MLP, sliding-window layers).
    """
    model_type = getattr(config, "model_type", type(config).__name__)
    arch = ARCHITECTURES.get(model_type)
    why = None
    if arch is None:
        why = f"model type {model_type!r} is not one the harness's decoders read ({', '.join(ARCHITECTURES)})"
    elif getattr(config, "hidden_act", "silu") != "silu":
        why = f"{model_type} with hidden_act={config.hidden_act!r} (the decoders compute SiLU-gated MLPs)"
    elif getattr(config, "mlp_bias", False):
        why = f"{model_type} with mlp_bias=true (the decoders compute bias-free MLPs)"
    elif getattr(config, "use_sliding_window", False) or any(
            t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        why = f"{model_type} with sliding-window layers (the decoders attend to every earlier token)"
    if why is not None:
        raise UnsupportedModel(f"{why}; set {FALLBACK}, which run any HF causal LM through its own forward")
    return arch


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
    """One decoder block: its norm scales (the tensors AQN perturbs in place), its projection groups
    and its attention shape.

    Args:
        input_norm: the RMSNorm scale before attention `[H]`. post_attention_norm: before the MLP.
        q_norm, k_norm: per-head RMSNorm scales `[head_dim]` (`Architecture.qk_norm`), else None.
        eps: the norms' epsilon.
        qkv, o, gate_up, down: the projection groups.
        heads, kv_heads, head_dim: the attention shape. scaling: the softmax scale.
    """

    input_norm: Tensor
    post_attention_norm: Tensor
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


@dataclass
class Decoder:
    """A causal LM as both decoders compute it.

    Args:
        arch: its declared architecture.
        embed: the token embedding `[V, H]`. blocks: the decoder blocks. norm: the final norm's
            scale. eps: its epsilon. lm_head: the output layer (its base layer, no adapter).
        rotary: HF's rotary embedding module (`rotary(x, position_ids) -> (cos, sin)`).
        config: the HF model config.
    """

    arch: Architecture
    embed: Tensor
    blocks: list[Block]
    norm: Tensor
    eps: float
    lm_head: nn.Module
    rotary: nn.Module
    config: object


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as every declared architecture computes it, rounded where HF rounds: in fp32, the
    normalised value cast to x's dtype, then times the scale (the torch definition both decoders'
    kernels are held to)."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def causal_lm(model: nn.Module) -> nn.Module:
    """The HF causal LM inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


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


def _norm_weight(module: nn.Module | None) -> Tensor | None:
    return None if module is None else module.weight


def read(model: nn.Module, adapters: bool = True) -> Decoder:
    """The decoder of `model`, its tensors the model's own (nothing is copied).

    Args:
        model: an HF causal LM of a declared architecture, or a peft model around one.
        adapters: read the active LoRA adapters (False: the base alone, the reference policy).

    Raises:
        UnsupportedModel: the architecture is not declared (`architecture`), or its adapters are
            not the plain unmerged LoRA both decoders apply.
    """
    lm = causal_lm(model)
    arch = architecture(lm.config)
    inner = lm.model
    blocks = []
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        d = attn.head_dim
        blocks.append(Block(
            input_norm=layer.input_layernorm.weight, post_attention_norm=layer.post_attention_layernorm.weight,
            q_norm=_norm_weight(attn.q_norm) if arch.qk_norm else None,
            k_norm=_norm_weight(attn.k_norm) if arch.qk_norm else None,
            eps=float(layer.input_layernorm.variance_epsilon),
            qkv=_group([attn.q_proj, attn.k_proj, attn.v_proj], adapters), o=_group([attn.o_proj], adapters),
            gate_up=_group([mlp.gate_proj, mlp.up_proj], adapters), down=_group([mlp.down_proj], adapters),
            heads=attn.q_proj.out_features // d, kv_heads=attn.k_proj.out_features // d, head_dim=d,
            scaling=float(getattr(attn, "scaling", d ** -0.5)),
        ))
    head, head_adapter = _adapter(lm.lm_head, adapters)
    if head_adapter is not None:
        raise UnsupportedModel(f"LoRA on lm_head; the decoders apply adapters inside the blocks; set {FALLBACK}")
    return Decoder(arch=arch, embed=inner.embed_tokens.weight, blocks=blocks, norm=inner.norm.weight,
                   eps=float(inner.norm.variance_epsilon), lm_head=head, rotary=inner.rotary_emb, config=lm.config)


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
