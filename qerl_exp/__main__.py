"""`python -m qerl_exp [overrides]`: one run; `-m` for a Hydra multirun (one run dir and W&B run per job).

`torchrun --nproc-per-node N -m qerl_exp [overrides]`: one data-parallel run on N processes
(`qerl_exp.distributed`); rank 0 owns the run dir and prints, the other ranks print only an error
that is theirs alone.
"""

from __future__ import annotations

import shlex
import signal
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from qerl_exp import distributed, rundir
from qerl_exp.cli import (CONF_DIR, UsageError, compose, fail, hydra_overrides, parse_command_line, search_path_of, set_keys,
                          tolerate_closed_pipes, validate)
from qerl_exp.config import ConfigError, as_dict, from_dict, register_configs


def _write_hydra_files(run_dir: Path, cfg: DictConfig) -> None:
    """Hydra's record of how the run was started (`.hydra/`), written once, into the run dir itself."""
    out = run_dir / ".hydra"
    if (out / "config.yaml").exists():  # a continued run keeps the record of its start
        return
    out.mkdir(exist_ok=True)
    hydra_cfg = HydraConfig.instance().cfg
    rundir.write_atomic(out / "config.yaml", OmegaConf.to_yaml(cfg))
    rundir.write_atomic(out / "hydra.yaml", OmegaConf.to_yaml(hydra_cfg))
    rundir.write_atomic(out / "overrides.yaml", OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task))


def _error_line(e: Exception, run_dir: Path, cache_dir: str) -> str:
    """One line for a failed run; the traceback goes to `run_dir/error.txt` when it can be written
    (by rank 0: the other ranks of a data-parallel run write no file). A storage fault names the
    setting that chose the path: `model.cache_dir` for the model cache, else `run_dir`."""
    line = None
    if isinstance(e, OSError):
        cached = isinstance(e.filename, str) and Path(e.filename).absolute().is_relative_to(Path(cache_dir).expanduser().absolute())
        line = rundir.os_error_line(e, "model.cache_dir" if cached else "run_dir")
    if line is None:
        text = str(e).strip()
        line = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    if not distributed.is_main():
        return f"rank {distributed.rank()}: {line}"
    try:
        if run_dir.is_dir():
            rundir.write_atomic(run_dir / "error.txt", traceback.format_exc())
            line += f" (traceback in {run_dir}/error.txt)"
    except OSError:
        pass
    return line


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float:
    # torch and the models: a refused config or --help answers without them
    from qerl_exp.train import DecoderMismatch, NonFiniteError, run, run_config

    hc = HydraConfig.get()
    run_dir = Path(cfg.resume or cfg.run_dir or hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    group = Path(hc.sweep.dir).name if multirun else ""
    try:
        # under torchrun, rank 0's: the other ranks' Hydra has no output dir of its own (cli.hydra_overrides)
        run_dir = distributed.broadcast(run_dir)
        # this job's overrides composed as validation composed them (Hydra's `cfg` is its record in .hydra/),
        # with the preset folders of its command line (--config-dir, hydra.searchpath)
        conf, choices = compose(list(hc.overrides.task) + search_path_of(hc.runtime.config_sources))
        if cfg.resume:  # continue with the config the run was started with; overrides may only extend it
            saved = rundir.read_config(run_dir)
            keys = set_keys(list(hc.overrides.task), rundir.flatten(as_dict(conf)))
            conf, choices = from_dict(rundir.resumed(run_dir, saved, as_dict(conf), keys)), saved.get("choices", {})
        with distributed.claim(run_dir, run_config(conf, choices)):
            if distributed.is_main():
                _write_hydra_files(run_dir, cfg)
            summary = run(conf, run_dir, choices=choices, group=group)
    except KeyboardInterrupt as e:  # SIGINT/SIGTERM (`rundir.Interrupted`), or SIGINT before the first step
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
            print(f"error: job {hc.job.num} refused: {e}", file=sys.stderr)
            raise
        distributed.refuse(str(e), code=1)  # every rank stops; rank 0 says why
    except distributed.CollectiveError as e:  # torchrun: another rank ended or hung
        if e.line():
            print(f"error: {e.line()}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - reported in one line, the traceback kept on disk
        message = _error_line(e, run_dir, cfg.model.cache_dir)
        if multirun:  # let Hydra record the failure and go on with the sibling jobs
            print(f"error: job {hc.job.num} failed: {message}", file=sys.stderr)
            raise
        if isinstance(e, (NonFiniteError, DecoderMismatch)):  # every rank reaches it at the same step
            distributed.refuse(message, code=1)
        fail(message, code=1)
    if distributed.is_main():
        print(f"run dir: {run_dir}  final reward: {summary['reward/final']:.3f} (mean of the last quarter of steps)")
    distributed.done()
    return summary["reward/final"]


def cli() -> None:
    tolerate_closed_pipes()
    register_configs()
    try:
        overrides, args = parse_command_line(sys.argv[1:])
    except UsageError as e:
        distributed.refuse(str(e))
    multirun = args.multirun
    if not (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion):
        try:
            configs = validate(overrides, multirun)
            distributed.check(configs[0], distributed.launched_world_size(), multirun)
        except (UsageError, ConfigError) as e:
            distributed.refuse(str(e))  # on every rank of a torchrun command, printed once
        distributed.init(configs[0].train.dist_timeout_s, configs[0].train.device)
        sys.argv += hydra_overrides(configs[0], overrides, multirun, main=distributed.is_main())
    main()


if __name__ == "__main__":
    cli()
