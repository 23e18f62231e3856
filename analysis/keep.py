"""`python -m analysis keep SWEEP_DIR DEST`: a sweep's finished trials (or a folder's finished runs)
as run records to keep.

Copies each finished trial's record (`config.json`, `metrics.jsonl`, `summary.json` and any
`eval*.json`) from `SWEEP_DIR/trials/` into `DEST/<config>_s<seed>/` (`<config>_b<base>_s<seed>/` on
an embedded base other than the default), the names results/results.md
and `python -m analysis` read; of a folder of run directories (no `trials/`, e.g. what
`sweeps/strategies.sh` writes) each run's record goes to the same path under DEST. Checkpoints and
adapters stay behind. A trial without
`summary.json` has not finished and is left out, with a line saying so. A record of the same name
already in DEST is replaced; anything else there is never touched: a folder of that name holding
other files (a run's `final/` or `checkpoints/`), or a DEST inside SWEEP_DIR, is refused before
anything is copied. `--gzip` keeps `metrics.jsonl` as `metrics.jsonl.gz`, which `python -m analysis`
reads the same.

Example:
    python -m analysis keep runs/smollm2_study results/smollm2_study
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path

from qerl_exp.run.console import one_line_argparse
from qerl_exp.run.files import temp_dir, user_path
from qerl_exp.run.record import run_holding

RECORD = ("config.json", "metrics.jsonl", "summary.json")


def record_name(config: dict, trial: Path) -> str:
    """`<config>_s<seed>` for a trial of a spec's `configs` (`<config>_b<base>_s<seed>` on an embedded
    base other than the default, `model.warmup.seed`); the trial folder's name otherwise."""
    name = config.get("choices", {}).get("config")
    base = (config.get("model", {}).get("warmup") or {}).get("seed", 0)
    return f"{name}{f'_b{base}' if base else ''}_s{config['seed']}" if name else trial.name


def _is_record(folder: Path) -> bool:
    """Whether `folder` holds a kept record and nothing else (files this command writes)."""
    return all(p.is_file() and (p.name in (*RECORD, "metrics.jsonl.gz") or (p.name.startswith("eval") and p.suffix == ".json"))
               for p in folder.iterdir())


def keep(sweep_dir: Path, dest: Path, packed: bool = False) -> tuple[list[Path], list[str]]:
    """Copy the finished trials' records of `sweep_dir` into `dest`.

    Args:
        sweep_dir: a sweep's directory (its `trials/`), or a folder of run directories.
        dest: where the records go.
        packed: keep `metrics.jsonl` as `metrics.jsonl.gz`.

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
    named = {path: None for path in configs}
    if not configs:  # a folder of run directories (sweeps/strategies.sh's OUT/NAME/sSEED): kept by their paths
        named = {path: path.parent.relative_to(sweep_dir).as_posix() for path in sorted(sweep_dir.rglob("config.json"))
                 if any((path.parent / n).is_file() for n in ("metrics.jsonl", "metrics.jsonl.gz"))}
    if not named:
        raise ValueError(f"{sweep_dir} holds no trials/*/config.json and no run directory; give the sweep_dir of a "
                         "python -m qerl_exp.sweep run or a folder of runs")
    finished, left_out = {}, []
    for path, relative in named.items():
        trial = path.parent
        if not (trial / "summary.json").is_file():
            left_out.append(f"{trial}: not finished (no summary.json)")
            continue
        name = relative or record_name(json.loads(path.read_text()), trial)
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
        out.parent.mkdir(parents=True, exist_ok=True)  # a name may hold folders (a trial's path)
        tmp = temp_dir(out.parent, prefix=f".{out.name}-")
        try:
            for f in [*(trial / n for n in RECORD), *sorted(trial.glob("eval*.json"))]:
                if packed and f.name == "metrics.jsonl":  # mtime 0: the same log packs to the same bytes
                    with open(f, "rb") as src, gzip.GzipFile(tmp / "metrics.jsonl.gz", "wb", mtime=0) as out_file:
                        shutil.copyfileobj(src, out_file)
                else:
                    shutil.copy2(f, tmp / f.name)
            if out.exists():  # a record, checked above: files this command wrote
                shutil.rmtree(out)
            tmp.rename(out)  # a record is whole or absent
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        written.append(out)
    return written, left_out


def main(argv: list[str]) -> int:
    p = one_line_argparse(argparse.ArgumentParser(prog="python -m analysis keep", description=__doc__.split("\n\n")[0]))
    p.add_argument("sweep_dir", type=user_path, help="a sweep's directory (python -m qerl_exp.sweep ... sweep_dir=)")
    p.add_argument("dest", type=user_path, help="where the records go, one folder per trial")
    p.add_argument("--gzip", action="store_true", help="keep each metrics.jsonl as metrics.jsonl.gz (about a sixth of the bytes)")
    args = p.parse_args(argv)
    try:
        written, left_out = keep(args.sweep_dir, args.dest, packed=args.gzip)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for line in left_out:
        print(f"left out {line}", file=sys.stderr)
    print(f"kept {len(written)} runs in {args.dest}")
    return 0
