"""The rules of the Qwen2.5-Coder-0.5B study, fixed before its runs
(results/protocols/qwen_coder_study.md). A run's gain is its mean training reward over steps 45-59
minus that over steps 0-9.

- Take-off (`sweeps/qwen_coder_check.yaml`): full precision takes off when, at one learning rate at
  least, every seed gains a quarter of its headroom (0.25 x (2.0 - its reward over steps 0-9)) or more.
- Pilot (`--pilot`, the check's and the pilot's runs together): full precision's rate and each 4-bit
  row's is the one with the higher mean reward over steps 45-59 across seeds (a lower rate within
  0.05 wins); a 4-bit row learns as full precision does when, at its rate, every seed gains at least
  half of full precision's mean gain at its rate, and fails when at both rates no seed gains a
  quarter of it; otherwise it is undecided.

    python3 sweeps/qwen_coder_takeoff.py sweeps/runs/qwen_coder_check   # exit status 0: it took off
    python3 sweeps/qwen_coder_takeoff.py --pilot results/qwen_coder_check results/qwen_coder_pilot

Reads each run's `config.json` and `metrics.jsonl` in a sweep directory (`trials/*/`) or a folder of
kept records (`*/`), with nothing but the standard library, so it runs before any package is
installed; prints every run's numbers and the verdicts.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

FIRST, LAST = range(0, 10), range(45, 60)  # the steps whose mean rewards are compared
MAX_REWARD = 2.0  # task=wordprob: 2.0 for the right number, no format reward
SHARE = 0.25  # of the headroom
LEARNS, FAILS = 0.5, 0.25  # of full precision's mean gain at its rate
TIE = 0.05  # a lower rate within this of the best mean reward over steps 45-59 wins
FOUR_BIT = ("nvfp4_lora_noaqn", "nvfp4_lora", "nf4_dq")


def gains(sweep_dir: Path, strategy: str = "full_precision") -> dict[float, list[tuple[int, float, float]]]:
    """Per learning rate, (seed, gain, headroom) of every finished run of `strategy` under `sweep_dir`."""
    out = defaultdict(list)
    configs = sorted(sweep_dir.glob("trials/*/config.json")) + sorted(sweep_dir.glob("*/config.json"))
    for config in configs:
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


def rate(by_rate: dict[float, list[tuple[int, float, float]]]) -> float:
    """The pilot's rate: the highest mean reward over steps 45-59 across seeds, a lower rate within
    `TIE` of it winning (the end reward is the gain plus the start, 2.0 minus the headroom)."""
    end = {lr: sum(g + MAX_REWARD - h for _, g, h in runs) / len(runs) for lr, runs in by_rate.items()}
    best = max(end.values())
    return min(lr for lr, value in end.items() if value >= best - TIE)


def pilot(folders: list[Path]) -> int:
    """Print each row's gains and the verdict of every 4-bit row against full precision."""
    def merged(strategy):
        out = defaultdict(list)
        for folder in folders:
            for lr, runs in gains(folder, strategy).items():
                out[lr] += runs
        return dict(out)

    reference = merged("full_precision")
    if not reference:
        print("no finished full-precision run")
        return 2
    lr = rate(reference)
    mean_gain = sum(g for _, g, _ in reference[lr]) / len(reference[lr])
    print(f"full_precision: rate {lr:g}, mean gain {mean_gain:+.3f}; a 4-bit row learns at >= {LEARNS * mean_gain:.3f}"
          f" a seed, fails below {FAILS * mean_gain:.3f}")
    for strategy in FOUR_BIT:
        by_rate = merged(strategy)
        if not by_rate:
            continue
        own = rate(by_rate)
        for r, runs in sorted(by_rate.items()):
            print(f"{strategy} lr {r:g}: gains " + ", ".join(f"seed {s} {g:+.3f}" for s, g, _ in sorted(runs)))
        if all(g >= LEARNS * mean_gain for _, g, _ in by_rate[own]):
            verdict = "learns as full precision does"
        elif all(g < FAILS * mean_gain for runs in by_rate.values() for _, g, _ in runs):
            verdict = "fails"
        else:
            verdict = "undecided"
        print(f"{strategy}: rate {own:g}, {verdict}")
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--pilot":
        return pilot([Path(a) for a in argv[1:]])
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
