"""Finding and loading finished runs, and refusing incomplete ones.

Sources, all turned into the same `Run`:
  - run directories written by `qerl_exp.train.run` (`config.json`, `metrics.jsonl`,
    `summary.json`), given directly, as globs, or as parent directories searched recursively;
  - offline W&B run files (`run-<id>.wandb`), given directly or found under a parent directory
    whose run has no `metrics.jsonl`;
  - a W&B project, through the public API (online).

`load` checks every run (`problems`) and returns the complete ones and, separately, the skipped
ones with the reason: a run that failed (its `error.txt` line), was cut short, or has missing
steps, corrupt lines, or missing or non-finite metrics is never averaged with the others. Each run
is read once, whatever names it: paths are compared resolved (a symlink, `a/../a`), a run's offline
W&B file is not read beside its directory, and a copy of a run (its wall times, which no two
processes repeat, equal at every step, with its config and seed) is left out as the same run (`same_run`).
"""

from __future__ import annotations

import glob
import gzip
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from qerl_exp.config import flatten

# Metrics every step of a complete run carries.
REQUIRED = (
    "reward",
    "entropy",
    "sampler/entropy",
    "noise/sigma",
    "perf/rollout_tok_s",
    "perf/step_s",
    "mem/weights_bytes",
    "mem/peak_bytes",
)
# Metrics of the noise monitor: present on every step k with k % monitor.every == 0.
MONITORED = ("entropy_gain",)

# Config keys that say nothing about the experiment (where it ran and was stored, how it was logged),
# and its replication units: the run seed and the embedded base (`model.warmup.seed`); runs that
# differ in these alone are one row's replicates.
IGNORED_KEYS = ("seed", "model.warmup.seed", "run_dir", "resume", "checkpoint", "choices", "base", "tracker", "_wandb",
                "model.cache_dir", "world_size", "train.dist_timeout_s", "commit")
# Config keys a strategy preset sets (conf/strategy/*.yaml).
STRATEGY_KEYS = ("quant", "lora", "noise", "rollout.quant", "algo.tis_cap")


@dataclass
class Run:
    """One training run, whatever it was read from.

    Args:
        name: the run's name (its directory name, or the W&B display name).
        source: where it was read from (a path, or `wandb:entity/project/id`).
        config: the resolved run config as nested dicts, with `choices` (the Hydra group choices).
        history: one dict of metrics per step, `step` included, sorted by step.
        finished: the run reached its end (a `summary.json`, or a W&B exit code 0).
        summary: the run's summary (empty when it has none).
        duplicate_steps: steps logged more than once (a restarted run appending to its log).
        strategy: the strategy preset the run is an instance of, or None (set by `label`).
        bad_lines: numbers of `metrics.jsonl` lines that are not JSON objects with a step.
        error: the last line of the run's `error.txt` (it failed), or empty.
    """

    name: str
    source: str
    config: dict
    history: list[dict]
    finished: bool
    summary: dict = field(default_factory=dict)
    duplicate_steps: list[int] = field(default_factory=list)
    strategy: str | None = None
    bad_lines: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def choices(self) -> dict:
        return self.config.get("choices") or {}

    @property
    def seed(self):
        return self.config.get("seed")

    def get(self, key: str, default=None):
        """A config value by dotted key, e.g. `run.get("quant.format")`."""
        return flatten(self.config).get(key, default)

    def series(self, metric: str) -> tuple[list[int], list[float]]:
        """(steps, values) of `metric` over the steps that logged it."""
        pairs = [(h["step"], h[metric]) for h in self.history if h.get(metric) is not None]
        return [p[0] for p in pairs], [float(p[1]) for p in pairs]


class RunError(ValueError):
    """A run that cannot be read at all (no config, unreadable files)."""


@dataclass
class Loaded:
    """The result of `load`: usable runs, skipped ones with the reason, notes, and the strategy
    presets the runs were labelled with (`strategy_presets`)."""

    runs: list[Run]
    skipped: list[tuple[str, str]]
    notes: list[str] = field(default_factory=list)
    presets: dict[str, dict] = field(default_factory=dict)
    # runs stopped before their last step with each logged step whole (a sweep cut short): kept
    # out of every table of finished runs; the results section compares what they logged
    unfinished: list[Run] = field(default_factory=list)


def _covered(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def settings(run: Run, also_ignore: Iterable[str] = ()) -> dict:
    """The run's flattened config without the keys in IGNORED_KEYS and `also_ignore`."""
    skip = (*IGNORED_KEYS, *also_ignore)
    return {k: v for k, v in flatten(run.config).items() if not _covered(k, skip)}


def differences(a: dict, b: dict) -> list[str]:
    """`key: a_value != b_value` for every key where two flat dicts differ."""
    keys = sorted(set(a) | set(b))
    return [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


# --------------------------------------------------------------------------- reading


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RunError(f"no readable {path.name} ({type(e).__name__})") from None


def metrics_text(run_dir: Path) -> str | None:
    """A run directory's `metrics.jsonl`, or the `metrics.jsonl.gz` a kept record holds instead
    (`python -m analysis keep --gzip`); None when it has neither."""
    plain, packed = Path(run_dir) / "metrics.jsonl", Path(run_dir) / "metrics.jsonl.gz"
    if plain.exists():
        return plain.read_text(errors="replace")
    if packed.exists():
        with gzip.open(packed, "rt", errors="replace") as f:
            return f.read()
    return None


def read_run_dir(path: Path) -> Run:
    """Read a run directory (`config.json`, `metrics.jsonl` or a kept record's `metrics.jsonl.gz`,
    optional `summary.json` and `error.txt`).

    Raises:
        RunError: `config.json` or `summary.json` is missing or unreadable.
    """
    path = Path(path)
    config = _read_json(path / "config.json")
    summary_file = path / "summary.json"
    summary = _read_json(summary_file) if summary_file.exists() else {}
    rows, bad = [], []
    text = metrics_text(path)
    if text is not None:
        for i, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    bad.append(i)
    run = _make_run(path.name, str(path), config, rows, summary_file.exists(), summary)
    run.bad_lines = bad + run.bad_lines
    if (path / "error.txt").is_file():
        lines = [line for line in (path / "error.txt").read_text(errors="replace").splitlines() if line.strip()]
        run.error = lines[-1].strip() if lines else "error.txt is empty"
    return run


def _make_run(name, source, config, rows, finished, summary) -> Run:
    by_step: dict[int, dict] = {}
    duplicates, bad = [], []
    for i, row in enumerate(rows, start=1):
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int):
            bad.append(i)
            continue
        if step in by_step:
            duplicates.append(step)
        by_step[step] = row
    history = [by_step[s] for s in sorted(by_step)]
    return Run(name, source, config, history, finished, summary, duplicates, bad_lines=bad)


def _wandb_records(path: Path) -> Iterable[bytes]:
    """The protobuf payloads of a `.wandb` transaction log.

    wandb <= 0.2x shipped a Python reader (`wandb.sdk.internal.datastore`), used when present.
    wandb 0.31 reads these files only in its Go core, so otherwise the framing is read here: a
    7-byte file header (":W&B", magic, version), then LevelDB-log records in 32 KiB blocks, each
    with a 7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last).
    """
    try:
        from wandb.sdk.internal import datastore  # type: ignore[attr-defined]
    except ImportError:
        datastore = None
    if datastore is not None:
        ds = datastore.DataStore()
        ds.open_for_scan(str(path))
        while (data := ds.scan_data()) is not None:
            yield data
        return
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise RunError("not a W&B transaction log (bad header)")
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding up to the block end
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        if len(chunk) < length:  # truncated: the writer did not finish this record
            return
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def read_wandb_file(path: Path) -> Run:
    """Read an offline W&B run file (`run-<id>.wandb`) into a `Run`.

    History rows are merged by the logged `step` (the harness logs a completions table as a
    separate row at the same step); nested values such as tables are dropped.

    Raises:
        RunError: the file is not a W&B transaction log.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    config, rows, summary, tags = {}, [], {}, []
    name, finished = Path(path).stem, False
    for data in _wandb_records(path):
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            name = record.run.display_name or name
            tags = list(record.run.tags)
            for item in record.run.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {}
            for item in record.history.item:
                keys = list(item.nested_key) or [item.key]
                if len(keys) == 1 and not keys[0].startswith("_"):
                    row[keys[0]] = json.loads(item.value_json)
            if "step" in row and len(row) > 1:
                rows.append(row)
        elif kind == "summary":
            for item in record.summary.update:
                keys = list(item.nested_key) or [item.key]
                if len(keys) == 1 and not keys[0].startswith("_"):
                    summary[keys[0]] = json.loads(item.value_json)
        elif kind == "exit":
            finished = record.exit.exit_code == 0
    if not config:
        raise RunError("no run record with a config")
    config.pop("_wandb", None)
    config.setdefault("choices", {t.split(":", 1)[0]: t.split(":", 1)[1] for t in tags if ":" in t})
    merged: dict[int, dict] = {}
    for row in rows:
        merged.setdefault(int(row["step"]), {}).update(row)
    # Rows of one step were merged above, so repeated steps cannot be detected here.
    return _make_run(name, str(path), config, [merged[s] for s in sorted(merged)], finished,
                     {k: v for k, v in summary.items() if k.count("/") <= 2})


def read_wandb_project(project: str, api=None) -> list[Run]:
    """Read every run of a W&B project through the public API (needs network and an API key).

    Args:
        project: `entity/project`.
        api: a `wandb.Api` (or an object with the same `runs(path)` method); None creates one.

    Returns:
        One `Run` per W&B run; a run's `finished` is its state being `finished`.
    """
    if api is None:
        import wandb

        api = wandb.Api()
    runs = []
    for r in api.runs(project):
        config = {k: v for k, v in dict(r.config).items() if not k.startswith("_")}
        config.setdefault("choices", {t.split(":", 1)[0]: t.split(":", 1)[1] for t in r.tags if ":" in t})
        rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in r.scan_history()]
        rows = [row for row in rows if row.get("step") is not None and len(row) > 1]
        merged: dict[int, dict] = {}
        for row in rows:
            merged.setdefault(int(row["step"]), {}).update(row)
        summary = {k: v for k, v in dict(r.summary).items() if not k.startswith("_")}
        runs.append(_make_run(r.name, f"wandb:{project}/{r.id}", config, [merged[s] for s in sorted(merged)],
                              r.state == "finished", summary))
    return runs


# --------------------------------------------------------------------------- finding


def discover(paths: Iterable[str]) -> tuple[list[Path], list[Path], list[tuple[str, str]]]:
    """Expand command-line paths into run directories and offline W&B files.

    A directory holding `config.json` is a run directory. Any other directory is searched
    recursively. A `.wandb` file is read when named, or when found under a parent whose run
    directory (the folder above `wandb/`) has no `metrics.jsonl` (otherwise the run directory is
    the source, and reading both would count the run twice).

    Returns:
        (run directories, W&B files, unmatched arguments with the reason).
    """
    run_dirs, wandb_files, bad = [], [], []
    for arg in paths:
        matches = sorted(glob.glob(arg, recursive=True)) if glob.has_magic(arg) else [arg]
        if not matches:
            bad.append((arg, "matches nothing"))
        for m in matches:
            p = Path(m)
            if p.is_file() and p.suffix == ".wandb":
                wandb_files.append(p)
            elif p.is_dir() and (p / "config.json").exists():
                run_dirs.append(p)
            elif p.is_dir():
                found = sorted(c.parent for c in p.rglob("config.json") if "wandb" not in c.parts[len(p.parts):])
                run_dirs.extend(found)
                for w in sorted(p.rglob("run-*.wandb")):
                    owner = next((a for a in w.parents if a.name == "wandb"), None)
                    if owner is None or not (owner.parent / "metrics.jsonl").exists():
                        wandb_files.append(w)
                if not found and not any(True for _ in p.rglob("run-*.wandb")):
                    bad.append((m, "holds no run directory (config.json) and no run-*.wandb file"))
            else:
                bad.append((m, "is neither a run directory, a parent of runs, nor a .wandb file"))
    run_dirs = _once(run_dirs)
    read = {d.resolve() for d in run_dirs}
    # a named W&B file of a run whose directory is read as well is the same run
    wandb_files = [w for w in _once(wandb_files) if w.resolve().parent.parent.parent not in read]
    return run_dirs, wandb_files, bad


def _once(paths: list[Path]) -> list[Path]:
    """`paths` without those that resolve to an earlier one (a symlink, `a/../a`), in order."""
    seen, out = set(), []
    for p in paths:
        if p.resolve() not in seen:
            seen.add(p.resolve())
            out.append(p)
    return out


# --------------------------------------------------------------------------- checking


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def problems(run: Run) -> list[str]:
    """Why `run` must not be averaged with others; empty when it is complete.

    A complete run finished, logged each step 0..train.steps-1 exactly once, and every step holds
    a finite value of each REQUIRED metric (and of each MONITORED metric on monitor steps).
    """
    if run.error and not run.finished:  # what it did log is partial by construction
        return [f"failed: {run.error}"]
    out = []
    if not run.finished:
        out.append("unfinished (no summary.json / W&B exit code 0)")
    if run.bad_lines:
        out.append(f"metrics.jsonl line(s) {run.bad_lines[:5]} are not JSON objects with a step (corrupt or half-written)")
    if run.duplicate_steps:
        out.append(f"steps logged more than once: {sorted(set(run.duplicate_steps))[:5]}")
    expected = run.get("train.steps")
    steps = [h["step"] for h in run.history]
    if not isinstance(expected, int):
        out.append("config has no train.steps")
    elif steps != list(range(expected)):
        missing = sorted(set(range(expected)) - set(steps))
        out.append(f"logged {len(steps)} of {expected} steps" + (f" (missing e.g. {missing[:5]})" if missing else ""))
    every = run.get("monitor.every", 0) or 0
    for name in (*REQUIRED, *MONITORED):
        want = steps if name in REQUIRED else [s for s in steps if every and s % every == 0]
        bad = [h["step"] for h in run.history if h["step"] in want and not _finite(h.get(name))]
        if bad:
            what = "missing or not finite"
            out.append(f"metric {name} {what} at {len(bad)} step(s), e.g. step {bad[0]}")
    return out


# --------------------------------------------------------------------------- strategies


def strategy_presets(conf_dir: Path | None = None) -> tuple[dict[str, dict], list[tuple[str, str]]]:
    """The config keys each strategy preset sets, composed by Hydra from `conf/strategy/*.yaml`.

    Returns:
        ({name: {dotted key: value}} restricted to STRATEGY_KEYS, [(name, why it did not compose)]).
    """
    from qerl_exp.config.compose import CONF_DIR, compose
    from qerl_exp.config import as_dict

    conf_dir = Path(conf_dir or CONF_DIR)
    presets, failed = {}, []
    for f in sorted((conf_dir / "strategy").glob("*.yaml")):
        try:
            cfg = as_dict(compose([f"strategy={f.stem}"])[0])
        except Exception as e:  # noqa: BLE001 - a preset the current schema rejects is reported
            failed.append((f.stem, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__))
            continue
        flat = flatten(cfg)
        presets[f.stem] = {k: v for k, v in flat.items() if _covered(k, STRATEGY_KEYS)}
    return presets, failed


# The adaptive controller's settings act only under noise.schedule=adaptive (their defaults have
# changed since older records were made).
_ADAPTIVE_ONLY = ("noise.target", "noise.target_value", "noise.target_relative", "noise.gain")


def preset_differences(run: Run, preset: dict, ignore: Iterable[str] = ()) -> list[str]:
    """The keys of a strategy preset (outside `ignore`) on which the run's config differs from it."""
    flat = flatten(run.config)
    if preset.get("noise.schedule") != "adaptive" and flat.get("noise.schedule") != "adaptive":
        ignore = (*ignore, *_ADAPTIVE_ONLY)
    # A key missing from an older run's config (e.g. rollout.quant) had its default: none / 0.
    return [k for k, v in preset.items() if not _covered(k, ignore)
            and ((k in flat and flat[k] != v) or (k not in flat and v not in ("none", 0, 0.0, False)))]


def label(runs: list[Run], presets: dict[str, dict]) -> list[str]:
    """Set `run.strategy` for each run; return notes on runs that claim a preset but differ from it.

    A run is an instance of a preset when its config matches every key the preset sets. The
    recorded choice (`choices["strategy"]`) names the preset to check first; a run that recorded a
    preset but overrode one of its keys (e.g. `strategy=nvfp4_lora lora=r32`) is no instance of it.
    """
    notes = []
    for run in runs:
        recorded = run.choices.get("strategy")
        order = ([recorded] if recorded in presets else []) + [p for p in presets if p != recorded]
        run.strategy = None
        for name in order:
            diffs = preset_differences(run, presets[name])
            if not diffs:
                run.strategy = name
                break
            if name == recorded:
                notes.append(f"{run.source}: recorded strategy={recorded} but overrides {', '.join(diffs[:3])}")
    return notes


# --------------------------------------------------------------------------- loading


def load(paths: Iterable[str], wandb_project: str | None = None, api=None, presets: dict | None = None) -> Loaded:
    """Find, read, check and label runs.

    Args:
        paths: run directories, parents of runs, globs, and `.wandb` files.
        wandb_project: also read this `entity/project` through the W&B public API.
        api: the W&B API object to use (tests pass a fake one).
        presets: strategy presets as from `strategy_presets()`; None composes them.

    Returns:
        `Loaded`: complete runs (labelled with their strategy) and skipped sources with reasons.

    Example:
        .. code-block:: python

            from analysis.runs import load

            loaded = load(["runs/strategies"])
            for source, why in loaded.skipped:
                print("skipped", source, why)
            print({r.strategy for r in loaded.runs})
    """
    run_dirs, wandb_files, skipped = discover(paths)
    runs: list[Run] = []
    for d in run_dirs:
        try:
            runs.append(read_run_dir(d))
        except RunError as e:
            skipped.append((str(d), str(e)))
    for f in wandb_files:
        try:
            runs.append(read_wandb_file(f))
        except (RunError, OSError) as e:
            skipped.append((str(f), str(e)))
    if wandb_project:
        try:
            runs.extend(read_wandb_project(wandb_project, api))
        except Exception as e:  # noqa: BLE001 - network and auth errors are reported, not fatal
            skipped.append((f"wandb:{wandb_project}", f"cannot read the project: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"))
    good, cut, first = [], [], {}
    for run in runs:
        key = _wall_times(run)
        if key in first:
            skipped.append((run.source, f"the same run as {first[key].source} (a copy or another path to it: "
                                        "its wall times equal that run's at every step)"))
            continue
        if key:
            first[key] = run
        why = problems(run)
        if why:
            skipped.append((run.source, "; ".join(why)))
            if _cut_short(run):
                cut.append(run)
        else:
            good.append(run)
    if presets is None:
        presets, failed = strategy_presets()
        skipped.extend((f"conf/strategy/{name}.yaml", f"preset does not compose: {why}") for name, why in failed)
    notes = label(good, presets)
    label(cut, presets)
    return Loaded(good, skipped, notes, presets, cut)


def _wall_times(run: Run) -> tuple:
    """What tells one run from another with the same config and seed, its per-step wall times, with
    that config and seed; empty when it logged none."""
    times = tuple(run.series("perf/step_s")[1])
    return (json.dumps(settings(run), sort_keys=True, default=str), run.seed, times) if times else ()


def same_run(a: Run, b: Run) -> bool:
    """Whether two runs are one run read twice (a copy, a link): one config and seed, and equal
    wall times at every step."""
    return bool(_wall_times(a)) and _wall_times(a) == _wall_times(b)


def _cut_short(run: Run) -> bool:
    """Unfinished and otherwise whole: steps 0..n-1 logged once each, n short of train.steps."""
    steps = [h["step"] for h in run.history]
    return (not run.finished and not run.error and not run.bad_lines and not run.duplicate_steps and bool(steps)
            and steps == list(range(len(steps))) and len(steps) < (run.get("train.steps") or 0))
