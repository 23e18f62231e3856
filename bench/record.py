"""A benchmark's table as a JSON record under `results/bench/`, which the docs' tables are made from.

    record.write("step", rows, meta={"steps": 3}, workload=("paper", "7b"))
    # results/bench/step/<device>-<commit>-paper-7b.json

A record names what made it: the commit (`-dirty` when the tree had changes; a copy of the tree
without its git folder is named by `QERL_COMMIT`, else by the package's version), the device, the
command line and the time; `rows` are the table's rows as printed. One file a (benchmark, device,
commit, workload): the workload (what the rows measured: shapes, batch sizes, rows) is in the
file's name, so records of other workloads at one commit sit side by side, and a rerun of the same
workload replaces its own record, never another's.
"""

from __future__ import annotations

import json
import platform
import re
import shlex
import sys
import time
from pathlib import Path

from qerl_exp.run.record import source_commit

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results" / "bench"


def commit() -> str:
    """The code's commit as runs record it (`qerl_exp.run.record.source_commit`), a git hash shortened to 7 digits."""
    return re.sub(r"^([0-9a-f]{7})[0-9a-f]{33}\b", r"\1", source_commit())


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+]+", "-", text.replace(",", "+")).strip("-").lower()


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


def write(bench: str, rows: list[dict], meta: dict | None = None, out: Path | None = None,
          workload: tuple[str, ...] = ()) -> Path:
    """Write `rows` (the printed table) with what made them; return the file's path.

    Args:
        bench: the benchmark's module name under `bench` (`quant`, `step`, ...).
        rows: one dict a printed row, numbers in the units the table prints (named in the keys).
        meta: the settings the table depends on beyond the command line (threads, shapes, ...).
        out: the folder (default `results/bench`); the record goes to `<out>/<bench>/`.
        workload: what selects the rows (workload, shapes, batch sizes, row names; commas become
            `+`), in the file's name after the device and commit.
    """
    dev = device()
    rev = commit()
    folder = (out or RESULTS) / bench
    folder.mkdir(parents=True, exist_ok=True)
    name = [re.sub(r"[^A-Za-z0-9]+", "-", dev).strip("-").lower(), rev, *(_slug(p) for p in workload)]
    path = folder / ("-".join(p for p in name if p) + ".json")
    record = {"bench": bench, "commit": rev, "device": dev, "command": "python -m bench." + bench + " "
              + shlex.join(sys.argv[1:]), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(meta or {}), "rows": rows}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    print(f"# recorded {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path
