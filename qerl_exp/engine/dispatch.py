"""Which kernel computes an NVFP4 launch's base product for M rows, from measured crossovers.

Two kinds, both finished by the same epilogue launch: "small", the decode kernels (`nvfp4_mma` up
to 8 rows where the segments tile by 64, else `_splitk_kernel`), and "wgmma" (`nvfp4_wgmma`: a TMA
ring and asynchronous wgmma, sm_90 only). `python -m bench.dispatch_sweep` times them for every 7B
launch shape at M in 1-256 and writes the table where `--out` says; the package's is `dispatch.json`
beside this module:

    {"device": "NVIDIA H200", "capability": [9, 0], "command": ...,
     "shapes": {"4608x3584": [[16, "small"], [32, "wgmma", {"BLOCK_M": 32, ...}], ...]}}

Shapes are keyed "NxK" (output columns of the launch, gate and up together for GLU, x inputs);
each entry is [up to this M, kind] or [up to this M, kind, measured tiles]. M rows take the first
entry whose bound is >= M (the last beyond them); a shape not in the table takes the entries of the
nearest one by weight size. The table holds on GPUs of the compute capability it was measured on
(H100 and H200 share sm_90); on any other, and with no table, every M takes "small": no
Hopper-only kernel on a GPU that lacks TMA and wgmma.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

KINDS = ("small", "wgmma")
TABLE_PATH = Path(__file__).with_name("dispatch.json")


@dataclass(frozen=True)
class Choice:
    """A dispatch decision.

    Args:
        kind: one of `KINDS`.
        tiles: measured tiles (`nvfp4_wgmma.config`'s keys for "wgmma"; for "small" a
            `linear.linear_config` override, which bypasses `nvfp4_mma`), or None for the kernel's own.
    """

    kind: str
    tiles: dict | None = None


@dataclass(frozen=True)
class Table:
    """A dispatch file: the capability it was measured on and, per shape, (bound, Choice) by bound."""

    capability: tuple[int, int]
    shapes: dict


@functools.lru_cache(maxsize=None)
def load_table(path: Path = TABLE_PATH) -> Table | None:
    """The dispatch file at `path` (None if it is absent).

    Raises:
        ValueError: an entry names an unknown kind or lacks its bound (one line, with the path).
    """
    if not path.exists():
        return None
    content = json.loads(path.read_text())
    shapes = {}
    for key, entries in content["shapes"].items():
        for e in entries:
            if not (isinstance(e, list) and 2 <= len(e) <= 3 and isinstance(e[0], int) and e[1] in KINDS):
                raise ValueError(f"{path}: entry {e} of shape {key} is not [rows, kind(, tiles)] with a kind in "
                                 f"{KINDS}; regenerate it with `python -m bench.dispatch_sweep --out PATH`")
        shapes[key] = sorted(((e[0], Choice(e[1], e[2] if len(e) == 3 else None)) for e in entries), key=lambda b: b[0])
    return Table(tuple(content["capability"]), shapes)


def choose(total_n: int, k: int, m: int, capability: tuple[int, int] | None, table: Table | None = None) -> Choice:
    """The kind for m rows of an NVFP4 launch with `total_n` output columns and `k` inputs.

    Args:
        total_n: output columns of the launch (gate and up together for GLU).
        k: input features.
        m: rows.
        capability: the GPU's compute capability; None (no GPU) takes "small".
        table: `load_table()`'s form; None reads `dispatch.json`.

    Returns:
        The measured choice of the shape (or of the nearest measured one) where the table was
        measured on this capability, else "small".
    """
    table = load_table() if table is None else table
    if table is None or capability is None or tuple(capability) != table.capability:
        return Choice("small")
    key = f"{total_n}x{k}"
    if key not in table.shapes:
        size = math.log(total_n * k)
        key = min(table.shapes, key=lambda s: abs(math.log(math.prod(int(v) for v in s.split("x"))) - size))
    entries = table.shapes[key]
    return next((c for bound, c in entries if bound >= m), entries[-1][1])


def write_table(path: Path, rows: list[dict], header: dict) -> dict:
    """Write a dispatch file from timed candidates; returns what was written.

    Args:
        path: where (normally `TABLE_PATH`).
        rows: one dict per (shape, m): "shape" ("NxK"), "m", "us", a dict of candidate name ->
            microseconds ("small", "wgmma", or "wgmma <tiles as JSON>"; NaN marks a failure).
        header: "device", "capability" ([major, minor]) and "command", stored beside the table.

    Returns:
        The file's content: per shape the fastest candidate at each measured M, runs of equal
        choices merged into their largest M.
    """
    shapes: dict = {}
    for r in sorted(rows, key=lambda r: (r["shape"], r["m"])):
        timed = {c: t for c, t in r["us"].items() if t == t}  # NaN: that candidate failed
        best = min(timed, key=timed.get)
        entry = [r["m"], best.split(" ", 1)[0]] + ([json.loads(best.split(" ", 1)[1])] if " " in best else [])
        runs = shapes.setdefault(r["shape"], [])
        if runs and runs[-1][1:] == entry[1:]:
            runs[-1][0] = entry[0]
        else:
            runs.append(entry)
    content = {**header, "shapes": shapes}
    body = ",\n".join(f"  {json.dumps(key)}: [" + ", ".join(json.dumps(e) for e in entries) + "]"
                      for key, entries in shapes.items())
    head = "".join(f" {json.dumps(key)}: {json.dumps(value)},\n" for key, value in header.items())
    path.write_text("{\n" + head + ' "shapes": {\n' + body + "\n }\n}\n")
    load_table.cache_clear()
    return content
