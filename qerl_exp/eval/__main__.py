"""`python -m qerl_exp.eval run_dir=RUN [k=8] [adapter=false] [split=ood] ...`: evaluate a finished run.

Rebuilds the run's policy from `RUN/config.json` (the same base, for the embedded model its cached
warm-up, and the same quantization), loads the trained adapter from `RUN/final/adapter`, grades
one of the run's evaluation splits with `qerl_exp.eval` and writes `RUN/eval.json` (the held-out
split) or `RUN/eval_ood.json` (the out-of-template one), and a W&B run of job type `eval`; a later
evaluation of the same run and split writes `RUN/eval-2.json`, and so on: none replaces another.
The file names its split (`"split"`), and so do its metrics (`eval/ood/...` for `ood`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from qerl_exp.cli import check_task
from qerl_exp.config import ConfigError, EvalConfig, as_dict, from_dict
from qerl_exp.eval import grade, samples_per_problem
from qerl_exp.models import build_models, resolve_device
from qerl_exp.rl.rollout import engine_for
from qerl_exp.run import logs, progress
from qerl_exp.run.checkpoint import adapter_file, load_adapter
from qerl_exp.run.console import (UsageError, fail, first_line, key_values, one_line_errors, require,
                                  tolerate_closed_pipes)
from qerl_exp.run.files import check_writable, user_path, write_atomic
from qerl_exp.run.record import DATA_KEY, DIGEST_KEYS, REWARDS_KEY, read_config
from qerl_exp.run.run_files import comparable, digests
from qerl_exp.run.tracking import run_tags
from qerl_exp.tasks import build_task, reader
from qerl_exp.tasks.base import HELD_OUT, SPLITS, check_split, epochs_done
from qerl_exp.tasks.reward_funcs import trainer_state


def run_config(run_dir: str | Path, checked: tuple[str, ...] = DIGEST_KEYS):
    """The validated `Config` a run was started with, read from `run_dir/config.json`, once the files
    it records digests of are found unchanged (`checked`, of `record.DIGEST_KEYS`).

    Raises:
        FileNotFoundError: there is no `config.json`.
        ValueError: it is unreadable, or a file it records changed since: the task's data (the
            held-out split would no longer be the run's) or chat template, a reward function's code
            (the scores would not be by the run's functions), or the base model's files (the adapter
            would be another base's).
    """
    path = Path(run_dir) / "config.json"
    saved = read_config(run_dir)
    if saved is None:
        raise FileNotFoundError(f"{path} does not exist: run_dir must be a run directory made by `python -m qerl_exp`")
    try:
        cfg = from_dict(saved)
    except Exception as e:  # noqa: BLE001 - OmegaConf raises many types for a schema that changed
        raise ValueError(f"{path} does not fit the current config schema ({str(e).strip().splitlines()[0]})") from None
    for key in ("path", "eval_path"):
        if getattr(cfg.task, key) and reader.missing(getattr(cfg.task, key), f"task.{key}"):
            raise ValueError(f"task.{key}={getattr(cfg.task, key)}, the run's data, does not exist: its held-out split is "
                             "read from it; restore that file")
    keys = tuple(k for k in checked if k in saved)
    now = comparable(saved, digests(cfg, keys))
    for key in keys:
        if saved[key] != now.get(key):
            raise ValueError(_changed(key, saved[key], now.get(key) or {}, cfg))
    return cfg


def _changed(key: str, recorded, now, cfg) -> str:
    """One line for a file a run recorded that has changed since (`run_config`)."""
    if key == DATA_KEY:
        field = next(k for k in recorded if recorded[k] != now.get(k))
        return (f"task.{field}={getattr(cfg.task, field)} changed since the run was trained (its sha256 differs from "
                "the one in config.json): its held-out split would not be the run's; restore that file")
    if key == REWARDS_KEY:
        name = next(n for n in recorded if recorded[n] != now.get(n))
        imports = [p for p, d in recorded[name].get("imports", {}).items() if (now.get(name) or {}).get("imports", {}).get(p) != d]
        what = f"the module {imports[0]} it imports" if imports and recorded[name].get("sha256") == (now.get(name) or {}).get(
            "sha256") else f"source {recorded[name]['file']}"
        return (f"reward function {name}'s {what} changed since the run was trained (its sha256 differs from the one in "
                "config.json): the scores would not be the run's; restore that file")
    where = f"model.gguf_file={cfg.model.gguf_file}" if cfg.model.gguf_file else f"model.name={cfg.model.name}"
    return (f"the base model's files ({where}) changed since the run was trained (their sha256 differs from the one in "
            "config.json): its adapter would be applied to another base; restore them")


def load_run(run_dir: str | Path, *, device: str = "auto", adapter: bool = True, quantized: bool = True,
             checked: tuple[str, ...] = DIGEST_KEYS):
    """Rebuild a run's policy: its base model and quantization, and (by default) its trained adapter.

    Args:
        run_dir: the run directory (`config.json`, `final/adapter`).
        device: `auto`, `cpu` or `cuda`.
        adapter: load `final/adapter`; False leaves the freshly initialized LoRA, which is the
            identity (peft initializes B to zero), so the policy is the quantized base.
        quantized: the base as the run stored it (`quant.format`); False: unquantized, in
            `model.dtype` (what `python -m qerl_exp.export merge=bf16` merges the adapter into).
        checked: the recorded digests that must still hold (`run_config`).

    Returns:
        `(cfg, task, models)`; `models.policy` is in eval mode; `cfg` is the run's config.
    """
    cfg = run_config(run_dir, checked)
    if adapter:
        adapter_file(Path(run_dir) / "final" / "adapter")  # before the model is built
    # Evaluation needs only the policy: no full-precision reference, no separate sampler copy.
    built = replace(cfg, monitor=replace(cfg.monitor, every=0), rollout=replace(cfg.rollout, quant="none"))
    if not quantized:
        built = replace(built, quant=replace(built.quant, format="none", double_quant=False))
    task = build_task(cfg.task)
    models = build_models(built, task, resolve_device(device, key="device"))
    if adapter:
        load_adapter(models.policy, Path(run_dir) / "final" / "adapter")
    models.policy.eval()
    return cfg, task, models


@dataclass
class EvalCommand:
    """`python -m qerl_exp.eval run_dir=RUN [key=value ...]`: which run to evaluate and how.

    The keys k, n, max_new_tokens and batch_size set `EvalConfig` (the settings in-training
    evaluation takes from `eval.*`); the others are these fields.

    Args:
        run_dir: the finished run's directory (holds `config.json` and `final/adapter`).
        eval: k, n, max_new_tokens (0 uses the run's `algo.max_new_tokens`) and batch_size.
        adapter: load the trained LoRA; false grades the quantized base alone (the baseline).
        split: `heldout` (phrased as training is) or `ood` (out of template, for tasks that have
            one: wordprob).
        limit: grade only the first `limit` problems of the split; 0 grades all. The split itself is
            always the run's (`task.eval_size` from its config), so training problems never leak in.
        temperature: temperature of the pass@k samples; 0 uses the run's `algo.temperature`.
        top_p: nucleus threshold of the pass@k samples; 0 uses the run's `algo.top_p`.
        device: `auto` (CUDA when present), `cpu` or `cuda`.
        seed: seed of the sampling stream.
        tracker: W&B mode for the results: `run` follows the run's `tracker.mode`; or `offline`,
            `online`, `disabled`.
        out: output file name inside run_dir, or a path elsewhere (e.g. for a read-only run dir),
            refused when it exists; empty means the first free one of `eval.json`, `eval-2.json`,
            ... (`eval_base*.json` when adapter=false; `eval_ood*.json`, `eval_base_ood*.json` for
            split=ood) in run_dir.
        verbose: show the third-party notices hidden by default (`qerl_exp.run.logs`).
    """

    run_dir: str = ""
    eval: EvalConfig = field(default_factory=EvalConfig)
    adapter: bool = True
    split: str = HELD_OUT
    limit: int = 0
    temperature: float = 0.0
    top_p: float = 0.0
    device: str = "auto"
    seed: int = 0
    tracker: str = "run"
    out: str = ""
    verbose: bool = False

    def __post_init__(self) -> None:
        require(bool(self.run_dir), "run_dir=<a run directory> is required")
        self.run_dir, self.out = str(user_path(self.run_dir)), str(user_path(self.out)) if self.out else ""
        for name in ("temperature", "top_p"):
            require(math.isfinite(getattr(self, name)), f"{name} must be a finite number, got {getattr(self, name)}")
        for name in ("limit", "temperature", "top_p"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0")
        require(self.top_p <= 1, "top_p must be <= 1")
        require(0 <= self.seed < 2**32, f"seed must be an integer in 0..{2**32 - 1}, got {self.seed}")
        require(self.split in SPLITS, f"split={self.split!r} is not valid; choose one of: {', '.join(SPLITS)}")
        require(self.device in ("auto", "cpu", "cuda"), f"device={self.device!r} is not valid; choose one of: auto, cpu, cuda")
        require(self.tracker in ("run", "offline", "online", "disabled"),
              f"tracker={self.tracker!r} is not valid; choose one of: run, offline, online, disabled")


# The command-line keys that set EvalConfig (its `every` is for training runs only).
_EVAL_KEYS = ("k", "n", "max_new_tokens", "batch_size")


def parse_args(argv: list[str]) -> EvalCommand:
    """`key=value` arguments into an `EvalCommand` and its `EvalConfig`; raises `UsageError` naming
    the bad argument."""
    eval_types = {f.name: f.type for f in fields(EvalConfig) if f.name in _EVAL_KEYS}
    own_types = {f.name: f.type for f in fields(EvalCommand) if f.name != "eval"}
    values = key_values(argv, {"run_dir": "str", **eval_types, **own_types})
    try:
        settings = EvalConfig(**{k: values.pop(k) for k in _EVAL_KEYS if k in values})
    except ConfigError as e:  # its messages name eval.KEY; here the key is KEY
        raise UsageError(str(e).replace("eval.", "")) from None
    return EvalCommand(eval=settings, **values)


def _new_output(run_dir: Path, out: str, adapter: bool, split: str) -> Path:
    """Create the empty output file of this evaluation (never one another evaluation wrote)."""
    stem = ("eval" if adapter else "eval_base") + ("" if split == HELD_OUT else f"_{split}")
    names = [out] if out else (f"{stem}.json" if i == 1 else f"{stem}-{i}.json" for i in itertools.count(1))
    for name in names:
        try:
            (run_dir / name).open("x").close()
            return run_dir / name
        except FileExistsError:
            continue
    raise ValueError(f"out={out}: {run_dir / out} exists, and an evaluation writes only a new file; choose another name")


def evaluate_run(args: EvalCommand) -> dict[str, float]:
    """Evaluate a finished run and write its results to a new file in `args.run_dir`.

    Args:
        args: the run directory and the evaluation settings (`EvalCommand`); `args.out` is set
            to the name of the file written, `args.temperature` and `args.top_p` to the values used.

    Returns:
        The `eval/...` metrics, also written to the output file together with the settings and
        one row per problem (question, reference, greedy completion, verdicts).

    Example:
        >>> evaluate_run(EvalCommand(run_dir="runs/my-run", eval=EvalConfig(k=8)))["eval/pass@8"]  # doctest: +SKIP
    """
    run_dir = Path(args.run_dir)
    if args.out and (run_dir / args.out).exists():
        raise ValueError(f"out={args.out}: {run_dir / args.out} exists, and an evaluation writes only a new file; "
                         "choose another name")
    if run_dir.is_dir():  # the results must have somewhere to go before the evaluation is paid for
        folder = (run_dir / (args.out or "eval.json")).parent
        if not folder.is_dir():
            raise ValueError(f"out={args.out}: {folder} is not a folder; create it or choose another out=")
        check_writable(folder)
    cfg = run_config(run_dir)
    check_split(built := build_task(cfg.task), args.split)  # before the model is built
    if not built.eval_problems(args.split):
        raise ValueError(f"run_dir={args.run_dir} holds no problem out for evaluation (its task.eval_size is 0 and it "
                         "has no task.eval_path): nothing to evaluate")
    check_task(cfg, ("max_new_tokens", args.eval.max_new_tokens or cfg.algo.max_new_tokens), model_fixed=True)
    cfg, task, models = load_run(run_dir, device=args.device, adapter=args.adapter)
    device = next(models.policy.parameters()).device
    algo = cfg.algo
    problems = task.eval_problems(args.split)[: args.limit or None]
    # what the samples are drawn with, recorded as such: these arguments, else (0) the run's
    args.temperature, args.top_p = args.temperature or algo.temperature, args.top_p or algo.top_p
    settings = args.eval
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": algo.top_k, "min_p": algo.min_p,
                "stop": list(algo.stop), "max_new_tokens": settings.max_new_tokens or algo.max_new_tokens}
    bar = progress.Progress(len(problems) * (1 + samples_per_problem(settings.k, settings.n)), "eval", unit="seq",
                            fields=())
    try:
        metrics, rows = grade(
            models.policy, models.tokenizer, task, problems=problems, k=settings.k, n=settings.n,
            temperature=args.temperature, top_p=args.top_p, top_k=algo.top_k, min_p=algo.min_p, stop=algo.stop,
            max_new_tokens=sampling["max_new_tokens"], batch_size=settings.batch_size,
            seed=args.seed, system_prompt=cfg.task.system_prompt, on_batch=bar.advance,
            engine=engine_for(cfg.rollout.engine if device.type == "cuda" else "hf", device),  # the run's, on its GPU
            split=args.split, state=trainer_state(cfg.train.steps, cfg.train.steps,  # the finished run's
                                                  epochs_done(task, cfg.train.steps, cfg.train.prompts_per_step,
                                                              cfg.train.steps)),
        )
    finally:
        bar.close()  # an error line after it starts a line of its own
    adapter = str(run_dir / "final" / "adapter") if args.adapter else None
    record = {"run_dir": str(run_dir), "adapter": adapter, "base": models.base_info, "task": cfg.task.name,
              "split": args.split, "args": asdict(args), "sampling": sampling, "metrics": metrics, "problems": rows}
    out = _new_output(run_dir, args.out, args.adapter, args.split)
    try:
        write_atomic(out, json.dumps(record, indent=2))
    except BaseException:
        out.unlink()  # the empty file that reserved the name
        raise
    args.out = out.name if out.parent == run_dir else str(out)
    mode = cfg.tracker.mode if args.tracker == "run" else args.tracker
    if mode != "disabled":
        _log_wandb(run_dir, cfg, metrics, mode, adapter)
    return metrics


def _log_wandb(run_dir: Path, cfg, metrics: dict[str, float], mode: str, adapter: str | None) -> None:
    """A W&B run of job type `eval` beside the training run (same project and task group). W&B points
    `wandb/latest-run` at the run it starts: it is pointed back at the training run's, which
    `wandb leet RUN/wandb` and the README's `wandb/latest-run/run-*.wandb` read."""
    import wandb  # only when the results go to W&B: importing it takes seconds

    os.environ.setdefault("WANDB_SILENT", "true")
    saved = json.loads((run_dir / "config.json").read_text())
    latest = run_dir / "wandb" / "latest-run"
    training = os.readlink(latest) if latest.is_symlink() else None
    try:
        run = wandb.init(
            dir=str(run_dir), mode=mode, project=cfg.tracker.project, entity=cfg.tracker.entity or None,
            name=f"{run_dir.name}-eval", group=cfg.task.name, job_type="eval",
            tags=run_tags(saved.get("choices", {}), cfg.model.name) + (["adapter:none"] if adapter is None else []),
            config={**as_dict(cfg), "eval": {"run_dir": str(run_dir), "adapter": adapter}},
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        run.log({"step": cfg.train.steps, **metrics})
        run.summary.update(metrics)
        run.finish()
    except Exception as e:  # noqa: BLE001 - a tracker fault must not lose results already written
        warnings.warn(f"W&B failed ({first_line(e)}); the results are in the evaluation file only")
    finally:
        if training is not None:
            _point(latest, training)


def _point(link: Path, target: str) -> None:
    """Make `link` a symlink to `target`, replacing what it is in one step (never missing)."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.symlink(target, tmp)
        os.replace(tmp, link)
    except OSError:  # the run dir became read-only: the link stays as W&B left it
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m qerl_exp.eval`."""
    tolerate_closed_pipes()
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(f"usage: python -m qerl_exp.eval run_dir=RUN [key=value ...]\n\n{EvalCommand.__doc__}\n{EvalConfig.__doc__}")
        return
    try:
        args = parse_args(argv)
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise UsageError("device=cuda needs a CUDA device and none is visible; use device=cpu (or auto)")
    except UsageError as e:
        fail(str(e))
    with one_line_errors("path (out=...)", "interrupted; an evaluation file is written only when the evaluation finishes"):
        with logs.quiet(args.verbose):
            metrics = evaluate_run(args)
    shown = "  ".join(f"{k}={v:.4g}" for k, v in metrics.items() if not k.endswith("seconds"))
    print(f"{shown}\nwritten: {Path(args.run_dir) / args.out}")



if __name__ == "__main__":
    main()
