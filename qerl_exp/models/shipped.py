"""The embedded bases shipped with the package, so that every machine starts from the same model.

The warm-up is deterministic on one kind of CPU, but its float sums round by the CPU's vector
kernels (AVX-512, AVX2) and a thousand AdamW steps amplify that: another kind of CPU stops at
another step with another model, and every row of a table moves with it. The RL steps from one
warmed-up model stay equal across kernels, so the package ships the default base (`model=tiny
task=arith`, `model.warmup.seed=0`) and `models.warmup.load_or_warm_up` takes a shipped base
whenever a run's warm-up spec hashes to its key.

Each shipped base is a folder `bases/tiny-<key>/` holding what `save_pretrained` wrote
(`config.json`, `generation_config.json`, `model.safetensors`), the warm-up's facts
(`warmup.json`) and `shipped.json`: the spec its key hashes (`warmup.tiny_cache_spec`), the
SHA-256 of its weights, and the commit, machine and command that made it. A test checks every
shipped base against its record by digest.

Made by (the warm-up command; it warms up, or takes the cached warm-up, and copies it here):

    python -m qerl_exp.models.warmup ship=true
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import sys
from pathlib import Path

BASES = Path(__file__).parent / "bases"
RECORD = "shipped.json"
FILES = ("config.json", "generation_config.json", "model.safetensors", "warmup.json")


def find(key: str, root: Path | None = None) -> Path | None:
    """The shipped base of a warm-up key (in `root`, the package's `bases/` by default), or None."""
    path = (root or BASES) / f"tiny-{key}"
    return path if (path / RECORD).is_file() else None


def sha256(path: Path) -> str:
    """The SHA-256 of a file, in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def machine() -> str:
    """The CPU and software the base was warmed up on, in one line."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}; torch {torch.__version__}, CPU kernels {torch.backends.cpu.get_cpu_capability()}; Python {sys.version.split()[0]}"


def ship(cached: Path, spec: dict, key: str, commit: str, command: str, root: Path | None = None) -> Path:
    """Copy a warmed-up base (`cached`, a warm-up cache folder) into the package with its record.

    Args:
        cached: the folder `load_or_warm_up` cached the base in.
        spec: the spec its key hashes.
        key: that key.
        commit: the code's commit (`record.source_commit`).
        command: the command that made it.
        root: where shipped bases go (the package's `bases/`).

    Returns:
        The shipped folder.
    """
    root = root or BASES
    out = root / f"tiny-{key}"
    tmp = root / f".tiny-{key}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in FILES:
        shutil.copy2(cached / name, tmp / name)
    warmup = json.loads((tmp / "warmup.json").read_text())
    record = {"key": key, "spec": spec, "weights_sha256": sha256(tmp / "model.safetensors"), "warmup_steps": warmup["steps"],
              "commit": commit, "machine": machine(), "command": command}
    (tmp / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
