"""A benchmark's table as a JSON record under `results/bench/`, which the docs' tables are made from.

    record.write("quant", rows, meta={"threads": 1})   # results/bench/quant/<device>-<commit>.json

A record names what made it: the commit (`-dirty` when the tree had changes), the device, the
command line and the time; `rows` are the table's rows as printed. One file a (benchmark, device,
commit): a rerun at the same commit on the same device replaces its own record, never another's.
"""

from __future__ import annotations

import json
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results" / "bench"


def commit() -> str:
    """The repository's commit, `-dirty` when its tracked files have changes; `unknown` outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def device() -> str:
    """The GPU's name, or the CPU's model name."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write(bench: str, rows: list[dict], meta: dict | None = None, out: Path | None = None) -> Path:
    """Write `rows` (the printed table) with what made them; return the file's path.

    Args:
        bench: the benchmark's module name under `bench` (`quant`, `step`, ...).
        rows: one dict a printed row, numbers in the units the table prints (named in the keys).
        meta: the settings the table depends on beyond the command line (threads, shapes, ...).
        out: the folder (default `results/bench`); the record goes to `<out>/<bench>/`.
    """
    dev = device()
    rev = commit()
    folder = (out or RESULTS) / bench
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{re.sub(r'[^A-Za-z0-9]+', '-', dev).strip('-').lower()}-{rev}.json"
    record = {"bench": bench, "commit": rev, "device": dev, "command": "python -m bench." + bench + " "
              + shlex.join(sys.argv[1:]), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(meta or {}), "rows": rows}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    print(f"# recorded {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path
