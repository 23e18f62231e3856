"""The take-off rule of `sweeps/qwen_coder_check.yaml`, fixed before its runs
(results/protocols/qwen_coder_study.md): a run's gain is its mean training reward over steps 45-59
minus that over steps 0-9; full precision takes off when, at one learning rate at least, every seed
gains a quarter of its headroom (0.25 x (2.0 - its reward over steps 0-9)) or more.

    python3 sweeps/qwen_coder_takeoff.py sweeps/runs/qwen_coder_check   # exit status 0: it took off

Reads each trial's `config.json` and `metrics.jsonl` (nothing but the standard library, so it runs
before any package is installed), prints every full-precision run's numbers and the verdict.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

FIRST, LAST = range(0, 10), range(45, 60)  # the steps whose mean rewards are compared
MAX_REWARD = 2.0  # task=wordprob: 2.0 for the right number, no format reward
SHARE = 0.25  # of the headroom


def gains(sweep_dir: Path, strategy: str = "full_precision") -> dict[float, list[tuple[int, float, float]]]:
    """Per learning rate, (seed, gain, headroom) of every finished run of `strategy` under `sweep_dir`."""
    out = defaultdict(list)
    for config in sorted(sweep_dir.glob("trials/*/config.json")):
        cfg = json.loads(config.read_text())
        if cfg.get("choices", {}).get("strategy") != strategy:
            continue
        rows = [json.loads(line) for line in (config.parent / "metrics.jsonl").read_text().splitlines() if line.strip()]
        reward = {r["step"]: r["reward"] for r in rows if "reward" in r}
        if not all(s in reward for s in (*FIRST, *LAST)):
            continue  # not finished
        start = sum(reward[s] for s in FIRST) / len(FIRST)
        end = sum(reward[s] for s in LAST) / len(LAST)
        out[cfg["train"]["lr"]].append((cfg["seed"], end - start, MAX_REWARD - start))
    return dict(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    by_rate = gains(Path(argv[0]))
    took_off = False
    for lr, runs in sorted(by_rate.items()):
        for seed, gain, headroom in runs:
            print(f"full_precision lr {lr:g} seed {seed}: gain {gain:+.3f}, needs {SHARE * headroom:.3f} "
                  f"({SHARE:g} x headroom {headroom:.3f})")
        took_off |= len(runs) >= 2 and all(gain >= SHARE * headroom for _, gain, headroom in runs)
    if not by_rate:
        print(f"no finished full-precision run under {argv[0]}")
    print("full precision took off: the pilot runs" if took_off else "full precision did not take off: the pilot does not run")
    return 0 if took_off else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
