"""Where metrics go: `metrics.jsonl` (always) and Weights & Biases (offline by default).

One JSON object per step in `metrics.jsonl` (`{"step": k, name: value, ...}`), one per sampled
completion in `completions.jsonl` every `tracker.completions_every` steps (always; also a W&B
table), a `summary.json` at the end, and a W&B run whose files live inside the run directory. W&B gets the resolved config,
a group/job_type/tags built from the Hydra choices, and `step` as the x-axis of every chart.

`tracker.mode=online` checks first that the W&B host resolves (a few seconds at most): without
network the run logs offline at once, with one warning, instead of waiting out W&B's init timeout.
A tracker fault never ends a run: when W&B cannot start its offline run either (its folder cannot
be written), or fails later (a table it cannot stage), the run goes on logging to `metrics.jsonl`
alone, with one warning. W&B's own folders under the home folder (`~/.local/share/wandb`,
`~/.cache/wandb`, `~/.config/wandb`) move into the run's `wandb/` folder when they cannot be written
(a read-only home), unless W&B's variables (`WANDB_DATA_DIR`, ...) name others.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import warnings
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from qerl_exp.config import TrackerConfig
from qerl_exp.run.files import check_writable, write_atomic

RESOLVE_TIMEOUT_S = 3.0


def run_tags(choices: dict[str, str], model: str = "") -> list[str]:
    """`group:choice` tags, e.g. `noise:adaptive`, `quant:nf4`. With `model` (`model.name`), a model
    preset that takes its model from `model.name` (`checkpoint`, or `tiny` given another name) is
    tagged with the model that ran: a hub id, or a checkpoint folder's name (`model:Qwen3-0.6B`).
    W&B keeps 64 characters of a tag."""
    tags = dict(choices)
    if model and model != "tiny" and tags.get("model") in ("checkpoint", "tiny"):
        folder = Path(model).expanduser()
        tags["model"] = folder.resolve().name if folder.is_dir() else model
    return [f"{group}:{choice}"[:64] for group, choice in sorted(tags.items())]


def _unreachable(base_url: str) -> str | None:
    """Why the W&B host of `base_url` cannot be reached, or None when its name resolves."""
    host = urlparse(base_url).hostname or base_url
    pool = ThreadPoolExecutor(max_workers=1)
    try:  # getaddrinfo has no timeout of its own; a dead DNS server would block for long
        pool.submit(socket.getaddrinfo, host, 443).result(timeout=RESOLVE_TIMEOUT_S)
    except FutureTimeout:
        return f"resolving {host} took over {RESOLVE_TIMEOUT_S:g} s"
    except OSError as e:
        return f"cannot resolve {host}: {e.strerror or e}"
    finally:
        pool.shutdown(wait=False)
    return None


@contextmanager
def _writable_wandb_folders(run_dir: Path):
    """W&B's folders in the home folder, moved into `run_dir/wandb/` where they cannot be written:
    its Python side reads `WANDB_DATA_DIR`, `WANDB_CACHE_DIR` and `WANDB_CONFIG_DIR` (set for the
    process: staging happens at any log), its service process the user's cache folder for its logs
    (`XDG_CACHE_HOME`, set only while the service starts: other libraries read it too)."""
    import platformdirs

    local = run_dir / "wandb" / ".home"
    for var, default in (("WANDB_DATA_DIR", platformdirs.user_data_dir("wandb")),
                         ("WANDB_CACHE_DIR", platformdirs.user_cache_dir("wandb")),
                         ("WANDB_CONFIG_DIR", platformdirs.user_config_dir("wandb"))):
        if var not in os.environ and not _can_write(default):
            os.environ[var] = str(local / var.removeprefix("WANDB_").lower())
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    moved = not _can_write(cache)
    if moved:
        os.environ["XDG_CACHE_HOME"] = str(local / "xdg_cache")
    try:
        yield
    finally:
        if moved:
            if cache == str(Path.home() / ".cache"):
                os.environ.pop("XDG_CACHE_HOME", None)
            else:
                os.environ["XDG_CACHE_HOME"] = cache


def _can_write(folder: str) -> bool:
    try:
        check_writable(folder)
        return True
    except OSError:
        return False


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _write(f, record: dict) -> None:
    """One JSON line; a full disk names the file (a resume drops the half-written line)."""
    try:
        f.write(json.dumps(record) + "\n")
    except OSError as e:
        raise OSError(e.errno, e.strerror, f.name) from e


def read_log(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    """The rows of `metrics.jsonl` (or another step log: `completions.jsonl`) that parse; a line
    half-written when the disk filled up (or cut by hand) is left out with its step."""
    path = run_dir / name
    rows = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)]


def logged_steps(run_dir: Path) -> int:
    """How many steps `metrics.jsonl` holds from step 0 without a gap: a resume may start at most there."""
    steps = {r["step"] for r in read_log(run_dir)}
    return next(i for i in range(len(steps) + 1) if i not in steps)


def truncate_log(run_dir: Path, next_step: int, name: str = "metrics.jsonl") -> list[dict]:
    """Keep the rows of a step log (`metrics.jsonl`, `completions.jsonl`) before `next_step` (a
    resumed run logs the rest again); return them."""
    rows = [r for r in read_log(run_dir, name) if r["step"] < next_step]
    if (run_dir / name).exists():
        write_atomic(run_dir / name, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


class Tracker:
    """Logs per-step metrics to `metrics.jsonl` and, unless disabled, to W&B.

    Args:
        run_dir: the run directory; `metrics.jsonl`, `summary.json` and `wandb/` go there.
        cfg: the tracker config.
        config: the resolved run config (plain dicts) to record.
        name: the run's name.
        group: W&B group (e.g. the sweep or the multirun).
        job_type: W&B job type.
        tags: W&B tags.
        run_id: the W&B run id to continue (a resumed run); None starts a new W&B run.
    """

    def __init__(self, run_dir: Path, cfg: TrackerConfig, config: dict, name: str, group: str, job_type: str,
                 tags: list[str], run_id: str | None = None):
        self.run_dir = Path(run_dir)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.samples = None  # completions.jsonl, opened at the first sample
        self.wandb = None
        self.run_id = run_id
        if cfg.mode == "disabled":
            return
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        kwargs = dict(dir=str(self.run_dir), project=cfg.project, entity=cfg.entity or None, name=name, group=group,
                      job_type=job_type, tags=tags, config=config, id=run_id, resume="allow" if run_id else None,
                      settings=wandb.Settings(console="off", x_disable_stats=True, init_timeout=60))
        mode = cfg.mode
        why = _unreachable(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")) if mode == "online" else None
        if why:
            warnings.warn(f"W&B is unreachable ({why}); logging offline instead (upload later with `wandb sync`)")
            mode = "offline"
        with _writable_wandb_folders(self.run_dir):
            self.wandb = self._init(wandb, mode, kwargs)
        if self.wandb is None:
            return
        self.run_id = self.wandb.id
        self._guarded(lambda run: (run.define_metric("step"), run.define_metric("*", step_metric="step")))

    def _guarded(self, call) -> None:
        """`call(run)` on the W&B run; a failure drops W&B for the rest of the run (one warning),
        which goes on logging to `metrics.jsonl`."""
        if self.wandb is None:
            return
        try:
            call(self.wandb)
        except Exception as e:  # noqa: BLE001 - W&B raises many types; the fallback is the same
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            warnings.warn(f"W&B failed ({why}); logging to metrics.jsonl only from here on")
            run, self.wandb = self.wandb, None
            try:
                run.finish(exit_code=1)
            except Exception:  # noqa: BLE001 - already failing: nothing more to report
                pass

    def _init(self, wandb, mode: str, kwargs: dict):
        """`wandb.init` in `mode`. A tracker fault must not end the run: a failing online init falls
        back to offline, a failing offline one (W&B cannot write its files) to `metrics.jsonl` alone."""
        before = set((self.run_dir / "wandb").glob("*"))
        try:
            return wandb.init(mode=mode, **kwargs)
        except Exception as e:  # noqa: BLE001 - W&B raises many types; the fallback is the same
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if mode != "online":
                warnings.warn(f"W&B cannot start its offline run in {self.run_dir / 'wandb'} ({why}); "
                              "logging to metrics.jsonl only")
                return None
            for half_made in set((self.run_dir / "wandb").glob("*")) - before:  # the failed online run's files
                if half_made.is_dir() and not half_made.is_symlink():
                    shutil.rmtree(half_made, ignore_errors=True)
                else:
                    half_made.unlink(missing_ok=True)
            warnings.warn(f"W&B online init failed ({why}); logging offline instead (upload later with `wandb sync`)")
            return self._init(wandb, "offline", kwargs)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        _write(self.jsonl, {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}})
        self._guarded(lambda run: run.log({"step": step, **metrics}))

    def log_completions(self, step: int, records: list[dict]) -> None:
        """The step's completions (`metrics.completion_records`): a line each in `completions.jsonl`,
        and a W&B table of them (a column per reward function)."""
        if self.samples is None:
            self.samples = open(self.run_dir / "completions.jsonl", "a", buffering=1)
        for record in records:
            _write(self.samples, record)
        if self.wandb is None or not records:
            return
        import wandb

        names, extra = list(records[0]["rewards"]), list(records[0].get("extra", {}))
        table = wandb.Table(columns=["step", "prompt", "completion", *names, "reward", "advantage", *extra],
                            data=[[r["step"], r["prompt"], r["completion"], *(r["rewards"][n] for n in names),
                                   r["reward"], r["advantage"], *(r["extra"][c] for c in extra)] for r in records])
        self._guarded(lambda run: run.log({"step": step, "completions": table}))

    def finish(self, summary: dict) -> None:
        write_atomic(self.run_dir / "summary.json", json.dumps({k: _jsonable(v) for k, v in summary.items()}, indent=2))
        self._guarded(lambda run: (run.summary.update(summary), run.finish()))
        self.wandb = None
        self.jsonl.close()
        if self.samples is not None:
            self.samples.close()

    def abort(self) -> None:
        """Close without a summary (the run failed); W&B marks the run failed."""
        self._guarded(lambda run: run.finish(exit_code=1))
        self.wandb = None
        for f in (self.jsonl, self.samples):
            try:
                if f is not None:
                    f.close()
            except OSError:  # the disk is full: the error being raised already says so
                pass


class NoTracker:
    """The tracker of a data-parallel run's other ranks: rank 0's `Tracker` logs for all of them,
    and these ranks write no file."""

    run_id = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def log_completions(self, step: int, records: list[dict]) -> None:
        pass

    def finish(self, summary: dict) -> None:
        pass

    def abort(self) -> None:
        pass
