"""Digests of model files, computed once: hashing a 15 GB checkpoint takes a minute, so each file's
sha256 is cached in `<model.cache_dir>/digests.json`, keyed by the file's path, size and
modification time. A run identifies its base by them (`pretrained.base_digest`), and a GGUF
file's converted checkpoint is named by its digest.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from qerl_exp.run.files import write_atomic

CACHE_FILE = "digests.json"
_ANNOUNCE_BYTES = 1 << 30


def file_digest(path: str | Path, cache_dir: str | Path) -> str:
    """The sha256 (hex) of a file, from `<cache_dir>/digests.json` when its size and modification
    time are those recorded there; computed (and recorded, where the cache can be written) otherwise."""
    path = Path(path).expanduser().absolute()
    stat = path.stat()
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    cache = Path(cache_dir).expanduser() / CACHE_FILE
    try:
        known = json.loads(cache.read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    entry = known.get(str(path))
    if isinstance(entry, dict) and all(entry.get(k) == v for k, v in key.items()) and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    if stat.st_size >= _ANNOUNCE_BYTES:
        print(f"computing the sha256 of {path} (once; kept in {cache})", file=sys.stderr, flush=True)
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    known[str(path)] = {**key, "sha256": h.hexdigest()}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cache, json.dumps(known, indent=1))
    except OSError:  # a cache that cannot be written only costs the time to hash again
        pass
    return h.hexdigest()
