"""`python -m analysis keep SWEEP_DIR DEST`: a sweep's finished trials as run records to keep.

Copies each finished trial's record (`config.json`, `metrics.jsonl`, `summary.json` and any
`eval*.json`) from `SWEEP_DIR/trials/` into `DEST/<config>_s<seed>/`, the names docs/results.md
and `python -m analysis` read; checkpoints and adapters stay behind. A trial without
`summary.json` has not finished and is left out, with a line saying so. A record of the same name
already in DEST is replaced; anything else there is never touched: a folder of that name holding
other files (a run's `final/` or `checkpoints/`), or a DEST inside SWEEP_DIR, is refused before
anything is copied.

Example:
    python -m analysis keep runs/smollm2_study docs/smollm2/study
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from qerl_exp.cli import one_line_errors
from qerl_exp.files import user_path
from qerl_exp.record import run_holding

RECORD = ("config.json", "metrics.jsonl", "summary.json")


def record_name(config: dict, trial: Path) -> str:
    """`<config>_s<seed>` for a trial of a spec's `configs`; the trial folder's name otherwise."""
    name = config.get("choices", {}).get("config")
    return f"{name}_s{config['seed']}" if name else trial.name


def _is_record(folder: Path) -> bool:
    """Whether `folder` holds a kept record and nothing else (files this command writes)."""
    return all(p.is_file() and (p.name in RECORD or (p.name.startswith("eval") and p.suffix == ".json"))
               for p in folder.iterdir())


def keep(sweep_dir: Path, dest: Path) -> tuple[list[Path], list[str]]:
    """Copy the finished trials' records of `sweep_dir` into `dest`.

    Returns:
        The record folders written, and one line per trial left out.

    Raises:
        ValueError: `sweep_dir` holds no trials, two trials would get one name, `dest` lies inside
            `sweep_dir`, or a folder in `dest` that a record would replace holds other files.
    """
    if dest.resolve().is_relative_to(sweep_dir.resolve()):
        raise ValueError(f"DEST {dest} is inside SWEEP_DIR {sweep_dir}: the records would replace or mix with "
                         "the trials they are copied from; give a DEST outside it")
    run = run_holding(dest)
    if run is not None:
        raise ValueError(f"DEST {dest} is in the run directory {run}: the records would mix with its files; "
                         "give a DEST outside it")
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"DEST {dest} is a file, not a directory; give a directory (created if needed)")
    configs = sorted((sweep_dir / "trials").glob("*/config.json"))
    if not configs:
        raise ValueError(f"{sweep_dir} holds no trials/*/config.json; give the sweep_dir of a python -m qerl_exp.sweep run")
    finished, left_out = {}, []
    for path in configs:
        trial = path.parent
        if not (trial / "summary.json").is_file():
            left_out.append(f"{trial}: not finished (no summary.json)")
            continue
        name = record_name(json.loads(path.read_text()), trial)
        if name in finished:
            raise ValueError(f"{finished[name]} and {trial} would both be kept as {name}; keep them into different DESTs")
        out = dest / name
        if out.is_symlink() or out.exists() and not (out.is_dir() and _is_record(out)):
            raise ValueError(f"{out} holds other files than a record this command keeps (a run's final/ or checkpoints/?); "
                             "it is left as it is: choose another DEST")
        finished[name] = trial
    written = []
    for name, trial in finished.items():
        out = dest / name
        dest.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest, prefix=f".{name}-"))
        try:
            for f in [*(trial / n for n in RECORD), *sorted(trial.glob("eval*.json"))]:
                shutil.copy2(f, tmp / f.name)
            if out.exists():  # a record, checked above: files this command wrote
                shutil.rmtree(out)
            tmp.rename(out)  # a record is whole or absent
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        written.append(out)
    return written, left_out


def main(argv: list[str]) -> int:
    p = one_line_errors(argparse.ArgumentParser(prog="python -m analysis keep", description=__doc__.split("\n\n")[0]))
    p.add_argument("sweep_dir", type=user_path, help="a sweep's directory (python -m qerl_exp.sweep ... sweep_dir=)")
    p.add_argument("dest", type=user_path, help="where the records go, one folder per trial")
    args = p.parse_args(argv)
    try:
        written, left_out = keep(args.sweep_dir, args.dest)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for line in left_out:
        print(f"left out {line}", file=sys.stderr)
    print(f"kept {len(written)} runs in {args.dest}")
    return 0
