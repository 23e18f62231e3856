"""Loading a safetensors checkpoint one decoder block at a time.

`from_pretrained` materialises the whole model in its dtype before anything can be quantized: 65 GB
at 32B in bf16. `load_blockwise` lays the model out on the meta device, reads the checkpoint shard
by shard, and hands each decoder block to `on_block` (e.g. quantize it) as soon as all its tensors
have been read, so the peak while loading is the quantized model plus the blocks still being read
(one or two: shards are written in layer order).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from qerl_exp.config import architectures


def shard_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files in their index's order (one file when unsharded).

    Raises:
        FileNotFoundError: the folder has no `model.safetensors` and no index of shards.
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [folder / name for name in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{folder} holds no model.safetensors nor model.safetensors.index.json")


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[attr] = tensor


def load_blockwise(folder: str | Path, dtype: torch.dtype, device: torch.device | str,
                   on_block: Callable[[nn.Module], None]) -> nn.Module:
    """An HF causal LM of a declared architecture read shard by shard, each decoder block passed to
    `on_block` once complete.

    Args:
        folder: a checkpoint folder (`config.json` and safetensors shards).
        dtype: the dtype of the model's floating tensors.
        device: where they are made.
        on_block: called with each decoder block as soon as all its tensors are loaded, before
            later blocks are read.

    Returns:
        The model, on `device`, in eval mode.

    Raises:
        ValueError: a tensor the model needs is not in the checkpoint.
        architectures.UnsupportedModel: its family is not declared (before anything is read).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, device = Path(folder), torch.device(device)
    config = AutoConfig.from_pretrained(folder)
    architectures.declared(config)  # its blocks are found where its family has them
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    blocks = architectures.layers(model)
    named = {id(p): name for name, p in model.named_parameters(remove_duplicate=True)}
    missing = set(named.values())
    per_block = [{named[id(p)] for p in block.parameters()} for block in blocks]
    done = [False] * len(blocks)
    for path in shard_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in missing:
                    continue  # e.g. a tied lm_head saved beside the embedding
                tensor = f.get_tensor(name)
                _assign(model, name, tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype))
                missing.discard(name)
                for i, names in enumerate(per_block):
                    if not done[i] and name in names and not names & missing:
                        done[i] = True
                        on_block(blocks[i])
    if missing:
        raise ValueError(f"{folder}: the checkpoint lacks {len(missing)} tensors the model needs, e.g. {sorted(missing)[0]}")
    inner = architectures.body(model)
    with device:  # buffers computed at construction (rotary frequencies) are made anew on the device
        inner.rotary_emb = type(inner.rotary_emb)(config=config)
    model.tie_weights()
    return model.eval()
