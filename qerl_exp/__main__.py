"""`python -m qerl_exp [overrides]`: one run; `-m` for a Hydra multirun (one run dir and W&B run per job).

`torchrun --nproc-per-node N -m qerl_exp [overrides]`: one data-parallel run on N processes
(`qerl_exp.run.distributed`); rank 0 owns the run dir and prints, the other ranks print only an error
that is theirs alone.
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import sys
import traceback
from pathlib import Path


def _interrupted_at_start(signum, frame) -> None:
    print("error: interrupted before the run started; nothing was written", file=sys.stderr)
    os._exit(128 + signum)


# Ctrl-C while the imports below take their seconds ends in one line, not importlib's traceback;
# `cli` hands SIGINT back once they are done (a SIGINT ignored by the shell stays ignored).
if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_at_start)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from qerl_exp.cli import Refused, hydra_overrides, parse_command_line, split_command_line, validate  # noqa: E402
from qerl_exp.config import ConfigError, as_dict, flatten, from_dict, register_configs  # noqa: E402
from qerl_exp.config.compose import CONF_DIR, config_of, select_presets, set_keys  # noqa: E402
from qerl_exp.run import distributed, rundir  # noqa: E402
from qerl_exp.run.console import UsageError, fail, tolerate_closed_pipes  # noqa: E402
from qerl_exp.run.files import os_error_line, write_atomic  # noqa: E402


def _write_hydra_files(run_dir: Path, cfg: DictConfig) -> None:
    """Hydra's record of how the run was started (`.hydra/`), written once, into the run dir itself."""
    out = run_dir / ".hydra"
    if (out / "config.yaml").exists() and rundir.started(run_dir):  # a continued run keeps the record of its start
        return
    out.mkdir(exist_ok=True)
    hydra_cfg = HydraConfig.instance().cfg
    write_atomic(out / "config.yaml", OmegaConf.to_yaml(cfg))
    write_atomic(out / "hydra.yaml", OmegaConf.to_yaml(hydra_cfg))
    write_atomic(out / "overrides.yaml", OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task))


def _error_line(e: Exception, run_dir: Path, cache_dir: str) -> str:
    """One line for a failed run; the traceback goes to `run_dir/error.txt` when it can be written
    (by rank 0: the other ranks of a data-parallel run write no file). A storage fault names the
    setting that chose the path: `model.cache_dir` for the model cache, else `run_dir`."""
    line = None
    if isinstance(e, OSError):
        cached = isinstance(e.filename, str) and Path(e.filename).absolute().is_relative_to(Path(cache_dir).expanduser().absolute())
        line = os_error_line(e, "model.cache_dir" if cached else "run_dir")
    if line is None:
        text = str(e).strip()
        line = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    if not distributed.is_main():
        return f"rank {distributed.rank()}: {line}"
    try:
        if run_dir.is_dir():
            write_atomic(run_dir / "error.txt", traceback.format_exc())
            line += f" (traceback in {run_dir}/error.txt)"
    except OSError:
        pass
    return line


# Hydra settings that name a run's directory: a run whose directory is named by none of them (nor by
# run_dir= or resume=) gets a default one, which is never another run's (`rundir.claim(fresh=True)`).
_DIR_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir")
_IN_PROCESS = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
# The failed jobs of this command's multirun, when they run in this process (Hydra's basic launcher).
_FAILED: list[str] = []


def _job_failed(hc, line: str) -> float:
    """A multirun job that failed says why in one line and lets the others run. In this process its
    failure is kept for the command's exit status; a job elsewhere (joblib, SLURM) raises it to its launcher."""
    print(f"error: job {hc.job.num} {line}", file=sys.stderr)
    if hc.launcher.get("_target_") != _IN_PROCESS:
        raise
    _FAILED.append(line)
    return float("nan")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float:
    # torch and the models: a refused config or --help answers without them
    from qerl_exp.decoders.blocks import DecoderMismatch
    from qerl_exp.train import NonFiniteError, run, run_config

    hc = HydraConfig.get()
    # the run's config is Hydra's composition of its overrides (also recorded in .hydra/), validated
    conf, choices = config_of(cfg, hc.runtime.choices)
    run_dir = Path(conf.resume or conf.run_dir or hc.runtime.output_dir)
    named = bool(conf.resume or conf.run_dir) or any(o.split("=")[0].lstrip("+~") in _DIR_KEYS for o in hc.overrides.hydra)
    multirun = hc.mode == RunMode.MULTIRUN
    group = Path(hc.sweep.dir).name if multirun else ""
    try:
        # under torchrun, rank 0's: the other ranks' Hydra has no output dir of its own (cli.hydra_overrides)
        run_dir = distributed.broadcast(run_dir)
        if conf.resume:  # continue with the config the run was started with; overrides may only extend it
            saved = rundir.saved_config(run_dir)
            keys = set_keys(list(hc.overrides.task), flatten(as_dict(conf)))
            conf, choices = from_dict(rundir.resumed(run_dir, saved, as_dict(conf), keys)), saved.get("choices", {})
        saved = rundir.saved_config(run_dir) if named else None  # a default name is a new run's
        with distributed.claim(run_dir, run_config(conf, choices, saved), fresh=not named) as owned:
            run_dir = run_dir if named else owned.path  # a default name in use: the one taken instead
            if distributed.is_main():
                _write_hydra_files(run_dir, cfg)
            summary = run(conf, owned, choices=choices, group=group)
    except KeyboardInterrupt as e:  # SIGINT/SIGTERM (`signals.Interrupted`), or SIGINT before the first step
        signum, step = getattr(e, "signum", signal.SIGINT), getattr(e, "step", None)
        if not distributed.is_main():
            pass
        elif not (run_dir / "config.json").exists():
            print(f"interrupted by {signal.Signals(signum).name} before the run started; nothing was written", file=sys.stderr)
        else:
            kept = f"step {step} checkpointed" if step is not None else "it continues from its last checkpoint"
            print(f"interrupted by {signal.Signals(signum).name} ({kept}); resume with: "
                  f"python -m qerl_exp resume={shlex.quote(str(run_dir))}", file=sys.stderr)
        sys.exit(128 + signum)
    except rundir.RunDirError as e:  # refused: nothing was written
        if multirun:
            return _job_failed(hc, f"refused: {e}")
        distributed.refuse(str(e), code=1)  # every rank stops; rank 0 says why
    except distributed.CollectiveError as e:  # torchrun: another rank ended or hung
        if e.line():
            print(f"error: {e.line()}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - reported in one line, the traceback kept on disk
        message = _error_line(e, run_dir, conf.model.cache_dir)
        if multirun:
            return _job_failed(hc, f"failed: {message}")
        if isinstance(e, (NonFiniteError, DecoderMismatch)):  # every rank reaches it at the same step
            distributed.refuse(message, code=1)
        fail(message, code=1)
    if distributed.is_main() and math.isnan(summary["reward/final"]):  # its summary says so too (null)
        print(f"run dir: {run_dir}  final reward: none (no reward function scored any completion at any step: each "
              "returned None; check task.reward_funcs against the data's columns)")
    elif distributed.is_main():
        print(f"run dir: {run_dir}  final reward: {summary['reward/final']:.3f} (mean of the last quarter of steps)")
    distributed.done()
    return summary["reward/final"]


def cli() -> None:
    if signal.getsignal(signal.SIGINT) is _interrupted_at_start:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    tolerate_closed_pipes()
    register_configs()
    try:
        options, ordered = split_command_line(sys.argv[1:])
        # the overrides with the preset folders of --config-dir, as every job composes them
        overrides, args = parse_command_line(sys.argv[1:])
        multirun, shown = args.multirun, bool(args.cfg or args.info or args.resolve)
        presets = []
        if args.help or args.hydra_help or args.shell_completion:
            configs = None  # Hydra answers these itself
        elif shown:
            configs = validate(overrides, multirun, check_machine=False)  # the config is shown, not run
        else:
            configs = validate(overrides, multirun)
            distributed.check(configs[0], distributed.launched_world_size(), multirun)
        if configs is not None:
            presets = select_presets(overrides, multirun)
    except (UsageError, ConfigError) as e:  # on every rank of a torchrun command, printed once
        distributed.refuse(str(e), code=1 if isinstance(e, Refused) else 2)
    except KeyboardInterrupt:
        fail("interrupted before the run started; nothing was written", code=130)
    # in the order Hydra's parser needs, with the presets the composition picks (`compose.select_presets`)
    sys.argv = [sys.argv[0], *options, *ordered, *presets]
    if configs is not None and not shown:
        distributed.init(configs[0].train.dist_timeout_s, configs[0].train.device)
        sys.argv += hydra_overrides(configs[0], overrides, multirun, main=distributed.is_main())
    if not multirun:
        main()
        return
    # A failed job has said why in one line. A job another launcher ran raises its failure at the
    # end of the multirun, with a traceback unless Hydra hands it on (HYDRA_FULL_ERROR).
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except Exception:  # noqa: BLE001 - the job's own line is printed
        sys.exit(1)
    if _FAILED:
        sys.exit(1)


if __name__ == "__main__":
    cli()
