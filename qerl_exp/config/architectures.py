"""The decoder families the harness reads, declared once: what each one's block is made of, where
its parts sit in the HF module tree, and which of its variants the hand-written decoders refuse.

Every reader of a model's structure goes through here: the decoders' tensor reader
(`qerl_exp.decoders.blocks.read`), AQN's norms (`pre_norms`), the quantized projections (`projections`), the
HF forward's decoder body (`body`), and the choices of `model.family` (a synthetic model is built
from its family's `config_class`). A model of an undeclared family is refused by each in one line.

Every declared family is the Llama block: an RMSNorm before attention and one before the MLP, RoPE,
grouped-query attention over all earlier tokens, a SiLU-gated MLP, its projections where
`PROJECTIONS` says. A family of that block is one `Architecture` entry; one whose pre-norms have
other names says so in `attention_norm` / `mlp_norm`. What only the decoders cannot compute (sliding
windows of every spelling, another activation, a biased MLP, soft-capped logits) is a `Variant` in
`VARIANTS`: every family refuses those for the decoders, and runs them through HF's own forward
(`FALLBACK`), which AQN and quantization read all the same.

The module holds declarations and attribute look-ups only (no torch), so that the config schema
and the weight formats read it without importing the decoders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

FALLBACK = "train.padding_free=false rollout.engine=hf"

# The Llama block's projections, by the names `quant.targets` and `lora.targets` use, and the path of
# each inside a decoder block.
PROJECTIONS = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
}


class UnsupportedModel(ValueError):
    """A model the harness does not read (undeclared), or whose variant its decoders do not compute;
    the message says what to do."""


def _sliding(config) -> str | None:
    """The setting that makes some layers attend to a window of recent tokens, as `name=value`
    (None: every layer attends to every earlier token). Spellings: Mistral's and Phi-3's
    `sliding_window`; Qwen2/Qwen3's `use_sliding_window` with `sliding_window` and
    `max_window_layers` (HF keeps `sliding_window` only when the flag is on); `layer_types` with a
    non-full entry (Gemma 2/3, Qwen2/Qwen3, Cohere 2, GPT-OSS); Llama 4's `attention_chunk_size`."""
    if getattr(config, "use_sliding_window", None):
        return (f"use_sliding_window=true (sliding_window={getattr(config, 'sliding_window', None)}, "
                f"max_window_layers={getattr(config, 'max_window_layers', None)})")
    types = getattr(config, "layer_types", None) or []
    windowed = sorted({t for t in types if t != "full_attention"})
    if windowed:
        return f"layer_types with {', '.join(windowed)}"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) is not False:
        return f"sliding_window={window}"
    chunk = getattr(config, "attention_chunk_size", None)
    return f"attention_chunk_size={chunk}" if chunk else None


def _activation(config) -> str | None:
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu"
    return None if act == "silu" else f"hidden_act={act!r}"


def _soft_cap(config) -> str | None:
    caps = [f"{k}={getattr(config, k)}" for k in ("attn_logit_softcapping", "final_logit_softcapping")
            if getattr(config, k, None) is not None]
    return ", ".join(caps) or None


@dataclass(frozen=True)
class Variant:
    """A setting of an HF config that the decoders do not compute.

    Args:
        found: the config -> what is set, as `name=value` (None: not this variant).
        computes: what the decoders compute instead, said in the refusal.
    """

    found: Callable[[object], str | None]
    computes: str


VARIANTS = (
    Variant(_sliding, "the decoders attend to every earlier token"),
    Variant(_activation, "the decoders compute SiLU-gated MLPs"),
    Variant(lambda c: "mlp_bias=true" if getattr(c, "mlp_bias", False) else None, "the decoders compute bias-free MLPs"),
    Variant(_soft_cap, "the decoders compute plain softmax attention and logits"),
)


@dataclass(frozen=True)
class Architecture:
    """A decoder family by its HF `model_type`, and what its block adds to the Llama block.

    Args:
        model_type: the checkpoint config's `model_type`.
        config_class: the name of its `transformers` config class (a synthetic model's config).
        qk_norm: an RMSNorm over each head's dims of q and k (`self_attn.q_norm`, `k_norm`), after
            the projections and before RoPE.
        attention_norm: the block's RMSNorm before attention, which feeds q, k and v (AQN's first).
        mlp_norm: the block's RMSNorm before the MLP, which feeds gate and up (AQN's second).
        variants: the settings the decoders refuse for this family.
    """

    model_type: str
    config_class: str
    qk_norm: bool = False
    attention_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    variants: tuple[Variant, ...] = VARIANTS

    def refusal(self, config) -> str | None:
        """Why the decoders do not compute a model of this family with `config` (None: they do)."""
        for variant in self.variants:
            found = variant.found(config)
            if found:
                return f"{self.model_type} with {found} ({variant.computes})"
        return None


ARCHITECTURES = {a.model_type: a for a in (
    Architecture("llama", "LlamaConfig"),  # Llama 2/3, SmolLM2
    Architecture("qwen2", "Qwen2Config"),  # Qwen2/2.5 (q/k/v bias), the embedded model's default family
    Architecture("qwen3", "Qwen3Config", qk_norm=True),
)}


def declared(config) -> Architecture:
    """The declared family of an HF model config, whatever its variant.

    Raises:
        UnsupportedModel: one line naming the model type and the declared families.
    """
    model_type = getattr(config, "model_type", type(config).__name__)
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        raise UnsupportedModel(f"model type {model_type!r} is not a declared architecture ({', '.join(ARCHITECTURES)}); "
                               "declare it in qerl_exp/config/architectures.py if its block is the Llama block")
    return arch


def architecture(config) -> Architecture:
    """The declared family of an HF model config, in a variant both decoders compute.

    Raises:
        UnsupportedModel: one line naming the model type or the variant's setting, and the fallback
            settings where HF's forward runs it.
    """
    model_type = getattr(config, "model_type", type(config).__name__)
    if model_type not in ARCHITECTURES:
        raise UnsupportedModel(f"model type {model_type!r} is not one the harness's decoders read "
                               f"({', '.join(ARCHITECTURES)}); set {FALLBACK}, which run it through HF's own forward "
                               "(or declare it in qerl_exp/config/architectures.py if its block is the Llama block)")
    arch = ARCHITECTURES[model_type]
    why = arch.refusal(config)
    if why is not None:
        raise UnsupportedModel(f"{why}; set {FALLBACK}, which run it through HF's own forward")
    return arch


def causal_lm(model):
    """The HF causal LM inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def body(model):
    """The decoder stack of a causal LM (embeddings, blocks, final norm, rotary tables), without its
    LM head: `lm.model` in every declared family."""
    lm = causal_lm(model)
    declared(lm.config)
    return lm.model


def layers(model) -> list:
    """The decoder blocks of a causal LM (or of a peft model around one), in order."""
    return list(body(model).layers)


def is_block(module) -> bool:
    """Whether `module` is one decoder block of a declared family (it holds every projection)."""
    try:
        for path in PROJECTIONS.values():
            module.get_submodule(path)
    except AttributeError:
        return False
    return True


def pre_norms(model) -> list[tuple[object, object]]:
    """Each block's two pre-norm modules `(before attention, before the MLP)`, by its family's names."""
    arch = declared(causal_lm(model).config)
    return [(getattr(b, arch.attention_norm), getattr(b, arch.mlp_norm)) for b in layers(model)]


def final_norm(model):
    """The norm after the last block."""
    return body(model).norm


def projections(model, targets) -> list[tuple[object, str, object]]:
    """`(parent, attribute, module)` of each projection named in `targets` (`PROJECTIONS`' names), in
    every block of `model` in order, or in `model` itself when it is one decoder block (a block
    quantized as it is loaded)."""
    blocks = [model] if is_block(model) else layers(model)
    found = []
    for block in blocks:
        for name, path in PROJECTIONS.items():
            if name in targets:
                parent, _, attr = path.rpartition(".")
                owner = block.get_submodule(parent)
                found.append((owner, attr, getattr(owner, attr)))
    return found
