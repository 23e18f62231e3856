"""What is live on the GPU at an RL run's memory peak, grouped by where it was allocated.

    python -m bench.profile.memory model=qwen2.5-7b-shape strategy=nvfp4_lora lora=r32 train.steps=2 ...
    python -m bench.profile.memory --out snap/ --top 30 <overrides>

Runs `qerl_exp.train.run` in this process with `torch.cuda.memory._record_memory_history` on, saves
the snapshot (`snapshot.pickle`, readable at https://pytorch.org/memory_viz), then replays its
allocation trace to find the moment of the highest allocated total and prints the blocks live then,
summed by the innermost frame outside torch and the innermost project frame. Recording starts
before the run allocates and keeps 2M events: "replayed peak" equals CUDA's max allocated unless the
trace overflowed.
"""

from __future__ import annotations

import argparse
import pickle
import tempfile
from collections import defaultdict
from pathlib import Path

import torch


from qerl_exp.cli import validate
from qerl_exp.train import run

GIB = 2**30


def owner(frames: list[dict]) -> str:
    """Where a block came from: the innermost frame outside torch (a model's or the project's line),
    and the innermost project frame when that differs."""
    def short(f: dict) -> str:
        return f"{f.get('filename', '?').split('site-packages/')[-1].split('/qerl_exp/')[-1]}:{f.get('line')} {f.get('name')}"

    outside = next((f for f in frames if "/torch/" not in f.get("filename", "")), None)
    ours = next((f for f in frames if "qerl_exp/" in f.get("filename", "")), None)
    if outside is None:
        return short(frames[0]) if frames else "?"
    return short(outside) if ours is None or ours is outside else f"{short(outside)} <- {short(ours)}"


def live_at_peak(snapshot: dict) -> tuple[int, list[tuple[int, str]]]:
    """Replay the trace of device 0; return the peak allocated bytes and the (size, owner) blocks live then.

    Recording starts before the run allocates anything, so the trace holds every block's allocation.
    """
    trace = snapshot["device_traces"][0] if snapshot["device_traces"] else []
    sizes, total, peak, peak_at = {}, 0, 0, -1
    for i, e in enumerate(trace):  # first pass: when the total was highest
        if e["action"] == "alloc":
            sizes[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif e["action"] == "free_requested" and e["addr"] in sizes:
            total -= sizes.pop(e["addr"])
    live: dict[int, dict] = {}
    for e in trace[: peak_at + 1]:  # second pass: which blocks were live then
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    return peak, [(e["size"], owner(e.get("frames", []))) for e in live.values()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="", help="folder for snapshot.pickle, peak.txt and the run (default: temporary)")
    ap.add_argument("--top", type=int, default=25, help="groups to print")
    args, overrides = ap.parse_known_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="qerl_mem_"))
    out.mkdir(parents=True, exist_ok=True)
    cfg = validate([*overrides, "tracker=disabled", "checkpoint.every=0", f"run_dir={out / 'run'}"], multirun=False)[0]
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    summary = run(cfg, out / "run")
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(out / "snapshot.pickle", "wb") as f:
        pickle.dump(snapshot, f)
    peak, blocks = live_at_peak(snapshot)
    groups: dict[str, int] = defaultdict(int)
    for size, who in blocks:
        groups[who] += size
    lines = [(f"max allocated (CUDA): {torch.cuda.max_memory_allocated() / GIB:.2f} GiB; replayed peak: {peak / GIB:.2f} GiB"
             f" in {len(blocks)} blocks; run summary peak: {summary.get('mem/peak_bytes', float('nan')) / GIB:.2f} GiB")]
    for who, size in sorted(groups.items(), key=lambda kv: -kv[1])[: args.top]:
        lines.append(f"{size / GIB:8.3f} GiB  {who}")
    text = "\n".join(lines)
    (out / "peak.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
