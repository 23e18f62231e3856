"""Which base-product path an NVFP4 linear takes for M rows, from measured crossovers.

Four candidates compute the same product into the split-K workspace, all finished by the same raw
epilogue launch: "small" (the decode kernels: `nvfp4_mma` up to 8 rows, else `_splitk_kernel`, norm
and shrink on load), "mma" (`mma_kernels._nvfp4_mma_kernel`, tensor-core tiles of 16-128 rows),
"wgmma" (`nvfp4_wgmma`: a TMA ring and asynchronous wgmma, 16 rows and more) and "dequant"
(dequantize + cuBLAS). `bench/kernels.py --sweep` times them for every 7B projection
shape at M in 1-256 against cuBLAS bf16 and writes `dispatch.json` beside this module:

    {"device": ..., "command": ..., "measured": true,
     "shapes": {"4608x3584": [{"m": 16, "kernel": "mma", "tiles": {...}, "us": {...}, "cublas_us": ...}, ...]}}

Shapes are keyed "NxK" (output columns of the launch, gate and up together for GLU, x inputs). The
entry for M rows is the first whose "m" is >= M (the last beyond them). A shape that is not in the
table takes the entries of the nearest one by weight size; with no table, `default_kind`.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

KINDS = ("small", "mma", "wgmma", "dequant")
TABLE_PATH = Path(__file__).with_name("dispatch.json")


@dataclass(frozen=True)
class Choice:
    """A dispatch decision.

    Args:
        kind: one of `KINDS`.
        tiles: measured tiles for "mma" (`mma_kernels.mma_config`) or "wgmma" (`nvfp4_wgmma.config`),
            or None for the kernel's own `TILES` table.
    """

    kind: str
    tiles: dict | None = None


def default_kind(m: int) -> str:
    """The choice without a measured table: the decode kernels at every M. "mma" and "dequant" are
    taken only where `bench/kernels.py --sweep` measured them faster (`dispatch.json`, H200)."""
    return "small"


@functools.lru_cache(maxsize=None)
def load_table(path: Path = TABLE_PATH) -> dict:
    """The "shapes" of a dispatch file, each shape's entries sorted by "m" ({} if the file is absent).

    Raises:
        ValueError: the file names an unknown kernel or lacks "m" / "kernel" (one line, with the path).
    """
    if not path.exists():
        return {}
    shapes = json.loads(path.read_text()).get("shapes", {})
    for key, entries in shapes.items():
        for e in entries:
            if e.get("kernel") not in KINDS or not isinstance(e.get("m"), int):
                raise ValueError(f"{path}: entry {e} of shape {key} needs an int 'm' and a 'kernel' in {KINDS}; "
                                 "regenerate it with `python bench/kernels.py --sweep`")
        entries.sort(key=lambda e: e["m"])
    return shapes


def choose(total_n: int, k: int, m: int, table: dict | None = None) -> Choice:
    """The path for m rows of an NVFP4 launch with `total_n` output columns and `k` inputs.

    Args:
        total_n: output columns of the launch (gate and up together for GLU).
        k: input features.
        m: rows.
        table: `load_table()`'s form; None reads `dispatch.json`.

    Returns:
        The measured choice of the shape (or of the nearest measured one), else `default_kind`.
    """
    shapes = load_table() if table is None else table
    if not shapes:
        return Choice(default_kind(m))
    key = f"{total_n}x{k}"
    if key not in shapes:
        size = math.log(total_n * k)
        key = min(shapes, key=lambda s: abs(math.log(math.prod(int(v) for v in s.split("x"))) - size))
    entries = shapes[key]
    e = next((e for e in entries if e["m"] >= m), entries[-1])
    return Choice(e["kernel"], e.get("tiles"))


def write_table(path: Path, rows: list[dict], header: dict) -> dict:
    """Write a dispatch file from timed candidates; returns what was written.

    Args:
        path: where (normally `TABLE_PATH`).
        rows: one dict per (shape, m): "shape" ("NxK"), "m", "us", a dict of candidate name ->
            microseconds (a kind of `KINDS`, or "mma <tiles as JSON>" / "wgmma <tiles as JSON>"; NaN
            marks a failure),
            and "cublas_us", bf16 cuBLAS's time (kept beside the entry, never chosen).
        header: "device", "command" and the like, stored beside the table.

    Returns:
        The file's content.
    """
    shapes: dict = {}
    for r in rows:
        timed = {c: t for c, t in r["us"].items() if t == t}  # NaN: that candidate failed
        best = min(timed, key=timed.get)
        entry = {"m": r["m"], "kernel": best.split(" ", 1)[0], "us": {c: round(t, 2) for c, t in r["us"].items()},
                 "cublas_us": round(r["cublas_us"], 2)}
        if " " in best:  # "mma {...}" / "wgmma {...}": a tile variant
            entry["tiles"] = json.loads(best.split(" ", 1)[1])
        shapes.setdefault(r["shape"], []).append(entry)
    content = {**header, "measured": True, "shapes": shapes}
    path.write_text(json.dumps(content, indent=1) + "\n")
    load_table.cache_clear()
    return content
