"""Command-line plumbing shared by `python -m qerl_exp` and the sweep command.

`compose(overrides)` is the one way a run's config is made: the command line, Hydra's entry
point, each sweep trial and the tests get `(Config, choices)` from it. Hydra reports a bad
override as a multi-line message or a traceback; before Hydra starts, `validate` composes every
job's config and turns any failure into one line that says what to change.

Presets kept outside the repository come in Hydra's own ways: `--config-dir DIR` (or
`--config-dir=DIR`, `-cd DIR`) and the override `hydra.searchpath=[file://DIR]`, both searched
after `conf/`. `parse_command_line` reads the command line with Hydra's own parser and turns
`--config-dir` into the search-path override it amounts to, so that validation, every job and
every sweep trial compose with the same presets Hydra sees.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import sys
import typing
import warnings
from contextlib import contextmanager
from pathlib import Path

import hydra
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf, open_dict

from qerl_exp.config import GROUPS, Config, ConfigError, as_dict, register_configs, to_config
from qerl_exp.retired import unknown_key_line
from qerl_exp.logs import quiet
from qerl_exp.rundir import RunDirError, check_writable, flatten, os_error_line, read_config

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class UsageError(ValueError):
    """Bad input from the command line or a spec file; the message is the whole report."""


SEARCH_PATH = "hydra.searchpath"


def _is_search_path(override: str) -> bool:
    return override.partition("=")[0].lstrip("+~") == SEARCH_PATH


def _search_path(overrides: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The entries of the `hydra.searchpath` override among `overrides`, and the other overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    entries, rest = [], []
    for o in overrides:
        if _is_search_path(o):
            entries += [str(e) for e in OverridesParser.create().parse_overrides([o])[0].value()]
        else:
            rest.append(o)
    return entries, rest


def search_dirs(overrides: list[str] | tuple[str, ...] = ()) -> list[Path]:
    """The preset folders of a run: `conf/`, then the `file://` folders of a `hydra.searchpath`
    override (as `--config-dir` adds them: `parse_command_line`)."""
    return [CONF_DIR, *(Path(e[len("file://"):]) for e in _search_path(overrides)[0] if e.startswith("file://"))]


def group_options(group: str, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The presets of `group` in `conf/` and in the folders `overrides` add to the search path."""
    return sorted({p.stem for d in search_dirs(overrides) for p in (d / group).glob("*.yaml")})


def with_search_path(overrides: list[str], folders: list[str]) -> list[str]:
    """`overrides` whose `hydra.searchpath` override also holds `folders` (`file://` or `pkg://`
    entries), ahead of its own entries, as Hydra orders `--config-dir` and `hydra.searchpath`."""
    entries, rest = _search_path(overrides)
    entries = list(dict.fromkeys([*folders, *entries]))
    if not entries:
        return rest
    quoted = ",".join("'" + e.replace("\\", "\\\\").replace("'", "\\'") + "'" for e in entries)
    return [*rest, f"{SEARCH_PATH}=[{quoted}]"]


def parse_command_line(argv: list[str]) -> tuple[list[str], argparse.Namespace]:
    """The command line as Hydra reads it (its own parser): the overrides, `--config-dir DIR` among
    them as the `hydra.searchpath` entry it adds, and the flags.

    Raises:
        UsageError: an argument Hydra would refuse, or a `--config-dir` that is not a folder.
    """
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def refuse(message: str) -> typing.NoReturn:
        raise UsageError(f"cannot parse the command line: {message} (options such as --config-dir DIR go before "
                         "or after all the overrides)")

    parser.error = refuse
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.config_dir:
        folder = Path(args.config_dir).expanduser().absolute()
        if not folder.is_dir():
            raise UsageError(f"--config-dir={args.config_dir} is not a folder; give the folder that holds your "
                             "preset groups (e.g. DIR/task/mine.yaml)")
        overrides = with_search_path(overrides, [f"file://{folder}"])
    return overrides, args


def search_path_of(sources) -> list[str]:
    """The `hydra.searchpath` override that rebuilds, inside a Hydra job, the search path of its
    command line (`--config-dir` and `hydra.searchpath`), from `HydraConfig.runtime.config_sources`."""
    providers = ("command-line", f"{SEARCH_PATH} in command-line")
    extra = [f"{s.schema}://{s.path}" for s in sources if s.provider in providers]
    return with_search_path([], extra)


def _dict_field(key: str) -> str | None:
    """The dict field (e.g. `task.chat_template_kwargs`) that the dotted `key` is a key of, if any."""
    node, parts = Config, key.split(".")
    for i, part in enumerate(parts[:-1]):
        hint = typing.get_type_hints(node).get(part)
        if hint is None:
            return None
        if not dataclasses.is_dataclass(hint):
            return ".".join(parts[: i + 1]) if typing.get_origin(hint) is dict else None
        node = hint
    return None


def _explain(exc: BaseException, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """One line for a Hydra/OmegaConf composition error."""
    text = str(exc)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    missing = re.search(r"Could not (?:find|load) '([^']+)'", text)
    if missing:
        group, _, choice = missing.group(1).rpartition("/")  # e.g. quant/bogus
        if group and any((d / group).is_dir() for d in search_dirs(overrides)):
            return f"{group}={choice} is not a preset; choose one of: {', '.join(group_options(group, overrides))}"
        if group == "hydra/launcher":
            return (f"hydra/launcher={choice} is not installed; choose one of: {', '.join(getattr(exc, 'options', None) or [])} "
                    "(joblib and submitit_local/submitit_slurm come with pip install 'qerl-exp[cluster]')")
    cause = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    key = getattr(cause, "full_key", None)
    detail = str(cause).strip().splitlines()[0] if str(cause).strip() else first
    if key and ("not in struct" in detail or re.search(r"Key '[^']+' not in '", detail)):
        field = _dict_field(key)
        if field:
            return (f"{field} is a dict whose keys are yours: add one with Hydra's +, +{key}=VALUE, or give it whole "
                    f"with ++{field}={{{key.rpartition('.')[2]}: VALUE}}")
        return unknown_key_line(key)
    if key:
        return f"bad value for '{key}': {detail}"
    if "Could not override" in first or "Error merging" in first:
        return f"{first} {detail}".strip()
    return first


def _is_hydra(override: str) -> bool:
    return override.lstrip("+~").startswith("hydra")


def _compose_hydra(overrides: list[str]) -> DictConfig:
    """Hydra's composition of `conf/config.yaml` with `overrides`, its own `hydra` node included."""
    register_configs()
    GlobalHydra.instance().clear()
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra.compose(config_name="config", overrides=overrides, return_hydra_config=True)


def compose(overrides: list[str]) -> tuple[Config, dict[str, str]]:
    """The validated run config of `overrides` and its group choices, as every run gets them.

    Args:
        overrides: Hydra overrides (`quant=nvfp4`, `train.steps=9`); `hydra...` ones are left to
            Hydra (`check_hydra_overrides`), but for `hydra.searchpath`, which finds the presets.

    Returns:
        `(config, choices)`: choices name the preset of each group of `config.GROUPS` and of
        `strategy` (e.g. `{"quant": "nvfp4", "strategy": "nvfp4_lora", ...}`), for tags and `config.json`.

    Raises:
        ConfigError: a value the schema rejects; Hydra's and OmegaConf's errors for overrides that
            do not compose (`validate` turns both into one line).
    """
    cfg = _compose_hydra([o for o in overrides if not _is_hydra(o) or _is_search_path(o)])
    picked = cfg.hydra.runtime.choices
    choices = {g: str(picked[g]) for g in (*GROUPS, "strategy") if picked.get(g) is not None}
    with open_dict(cfg):
        del cfg["hydra"]
    config = to_config(cfg)
    if choices.get("model") == EMBEDDED and config.model.source == "pretrained":
        config = _checkpoint_defaults(config, overrides)
    return config, choices


EMBEDDED = "tiny"  # the preset of the embedded model, the default of the `model` group


def _checkpoint_defaults(cfg: Config, overrides: list[str]) -> Config:
    """`model.name=<a checkpoint>` on the embedded model's preset: the settings that preset tunes for
    the embedded model (lr, completion length, the monitor) take the schema's defaults instead, as
    for a checkpoint preset, unless the command line or another preset set them."""
    tuned = flatten({k: v for k, v in OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{EMBEDDED}.yaml")).items()
                            if k != "model"})
    named = [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o]
    composed, default = flatten(as_dict(cfg)), flatten(as_dict(Config()))
    groups: dict[str, dict] = {}
    for key, value in tuned.items():
        if composed[key] == value and not any(key == n or key.startswith(n + ".") for n in named):
            group, leaf = key.split(".", 1)
            groups.setdefault(group, {})[leaf] = default[key]
    return dataclasses.replace(cfg, **{g: dataclasses.replace(getattr(cfg, g), **v) for g, v in groups.items()})


def check_hydra_overrides(overrides: list[str]) -> None:
    """Compose Hydra's own config with the `hydra...` overrides (launcher choice and settings); raises as Hydra does."""
    own = [o for o in overrides if _is_hydra(o)]
    if own:
        _compose_hydra(own)


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """The per-job override lists of a Hydra multirun command line (comma and range sweeps)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    axes = []
    for o in parsed:
        if o.is_sweep_override():
            axes.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([o.input_line])
    return [list(job) for job in itertools.product(*axes)]


def validate(overrides: list[str], multirun: bool) -> list[Config]:
    """Compose and validate every job's config; raise `UsageError` with one line on the first bad one."""
    try:
        jobs = expand_sweep(overrides) if multirun else [overrides]
    except Exception as e:  # noqa: BLE001 - the parser's errors are user errors
        raise UsageError(f"cannot parse the overrides: {str(e).strip().splitlines()[0]}") from None
    configs = []
    for job in jobs:
        try:
            check_hydra_overrides(job)
            configs.append(compose(job)[0])
            preflight(configs[-1])
        except (ConfigError, RunDirError) as e:
            raise UsageError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - Hydra/OmegaConf raise many types for bad overrides
            raise UsageError(_explain(e, job)) from None
    return configs


def require(ok: bool, message: str) -> None:
    """Raise `UsageError(message)` unless `ok`: a command's argument checks."""
    if not ok:
        raise UsageError(message)


def key_values(argv: list[str], types: dict[str, str]) -> dict[str, object]:
    """`key=value` arguments of a command (`python -m qerl_exp.eval`, `.export`) as typed values.

    Args:
        argv: the arguments.
        types: each key's type, as a dataclass field names it: `str`, `int`, `float` or `bool`.

    Raises:
        UsageError: one line naming the argument that is not key=value, not a key, or not of its type.
    """
    values = {}
    for arg in argv:
        key, sep, raw = arg.partition("=")
        if not sep:
            raise UsageError(f"argument {arg!r} is not key=value; keys: {', '.join(types)}")
        if key not in types:
            raise UsageError(f"unknown argument {key!r}; keys: {', '.join(types)}")
        kind = types[key]
        try:
            if kind == "bool":
                if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                values[key] = raw.lower() in ("true", "1", "yes")
            else:
                values[key] = {"int": int, "float": float, "str": str}[kind](raw)
        except ValueError:
            raise UsageError(f"bad value for {key!r}: {raw!r} is not a {kind}") from None
    return values


def set_keys(overrides: list[str], composed: dict[str, object]) -> set[str]:
    """The dotted config keys `overrides` set: each `key=value`, and every key a group choice changes.

    Args:
        overrides: the command line's overrides.
        composed: the flattened config they composed (`rundir.flatten(as_dict(cfg))`).

    Returns:
        Dotted keys, e.g. `{"lora.r", "train.steps"}` for `lora.r=32 train.steps=9`.
    """
    base = flatten(as_dict(compose([])[0]))
    named = [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o]
    return {k for k in composed if composed[k] != base.get(k) or any(k == n or k.startswith(n + ".") for n in named)}


def hydra_overrides(cfg: Config, overrides: list[str], multirun: bool, main: bool = True) -> list[str]:
    """What Hydra is told besides the user's overrides, so that it writes nowhere but the run dir.

    Hydra writes `.hydra/` and a log file into its output dir before the run starts; the run
    writes `.hydra/` itself once it owns its directory (a refused run writes nothing), Hydra's log
    file appears only when something is logged, and a `run_dir=` or `resume=` run is Hydra's
    output dir (no empty `runs/<date>/<time>_...` dir beside it).

    Args:
        cfg: the (first) job's validated config.
        overrides: the command line's overrides.
        multirun: a `-m` command (each job's dir is Hydra's sweep subdir).
        main: False on the ranks of a torchrun command other than 0: their Hydra gets no output dir
            and no log file (rank 0's Hydra and run write the run dir).

    Returns:
        Overrides to append to the command line.
    """
    if not main:
        return ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    extra = ["hydra.output_subdir=null"]
    if not any(o.startswith("hydra/job_logging") for o in overrides):
        extra.append("++hydra.job_logging.handlers.file.delay=true")
    target = cfg.resume or cfg.run_dir
    if target and not multirun and not any(o.startswith("hydra.run.dir=") for o in overrides):
        escaped = target.replace("\\", "\\\\").replace("'", "\\'")
        extra.append(f"hydra.run.dir='{escaped}'")
    return extra


def preflight(cfg: Config) -> None:
    """Checks that need the machine, not only the config: files exist, packages import, devices exist.

    Raises:
        ConfigError: one line naming the field and what to change.
    """
    for key, fmt in (("quant.format", cfg.quant.format), ("rollout.quant", cfg.rollout.quant)):
        if fmt == "nf4":
            try:
                with quiet(cfg.verbose):
                    import bitsandbytes  # noqa: F401
            except Exception as e:  # noqa: BLE001 - a broken install raises more than ImportError
                raise ConfigError(f"{key}=nf4 needs bitsandbytes, which does not import here ({type(e).__name__}); "
                                  "pip install bitsandbytes, or choose quant=nvfp4") from None
    _check_task(cfg)
    if cfg.resume and not (Path(cfg.resume) / "config.json").is_file():
        raise ConfigError(f"resume={cfg.resume} is not a run directory (no config.json in it)")
    if cfg.resume:
        read_config(cfg.resume)  # one line naming the file when it is not JSON
        if cfg.run_dir and Path(cfg.run_dir).absolute() != Path(cfg.resume).absolute():
            raise ConfigError(f"resume={cfg.resume} continues that run in its own directory, but run_dir={cfg.run_dir} "
                              "names another; drop run_dir=")
    for key, path in (("run_dir", cfg.run_dir), ("resume", cfg.resume)):
        if path and Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"{key}={path} is a file, not a directory; choose another {key}")
    _check_writable(Path(cfg.resume or cfg.run_dir or "runs"), "run_dir")
    if (cfg.model.source == "synthetic" and cfg.model.warmup.max_steps) or cfg.model.gguf_file or cfg.model.package:
        _check_writable(Path(cfg.model.cache_dir).expanduser(), "model.cache_dir")  # where the model is cached
    if cfg.model.source == "pretrained" and cfg.model.name.startswith(("/", ".", "~")) and not Path(cfg.model.name).expanduser().is_dir():
        raise ConfigError(f"model.name={cfg.model.name} is not a directory; give a checkpoint directory or a hub id")
    if "cuda" in (cfg.train.device, cfg.rollout.engine.replace("fast", "cuda")):
        import torch

        if not torch.cuda.is_available():
            key = "train.device=cuda" if cfg.train.device == "cuda" else "rollout.engine=fast"
            raise ConfigError(f"{key} needs a CUDA device and none is visible; use {key.split('=')[0]}={'cpu' if key.startswith('train') else 'hf'}")
    if cfg.noise.resample == "forward" and cfg.noise.schedule != "none":
        import torch

        auto_fast = cfg.rollout.engine == "auto" and cfg.train.device != "cpu" and torch.cuda.is_available()
        if cfg.rollout.engine == "fast" or auto_fast:
            raise ConfigError("noise.resample=forward draws noise anew for every forward pass, which the fast engine's "
                              "captured decode step cannot; use noise.resample=step, or rollout.engine=hf")


def _check_task(cfg: Config) -> None:
    """The task's sources, chat template file and reward functions; and, when its data is here, the
    task itself as a run builds it (its rows, and its reward functions against their columns)."""
    from qerl_exp.tasks import build_task, reader, reward_funcs

    task = cfg.task
    if task.name == "dataset" and not task.path:
        raise ConfigError(f"task=dataset needs task.path=<{reader.SOURCES}>")
    if task.chat_template_file and not Path(task.chat_template_file).expanduser().is_file():
        raise ConfigError(f"task.chat_template={task.chat_template} is neither a Jinja template (it holds no "
                          "{{ or {%) nor an existing file; give one of them")
    try:
        sources = (("path", task.path), ("eval_path", task.eval_path))
        kinds = [reader.kind(value, f"task.{key}") for key, value in sources if value]
        if reader.HUB in kinds or task.name == "gsm8k" and not task.path:
            reward_funcs.load(task)  # the data is read when the run starts; its columns are checked then
            return
        with warnings.catch_warnings():  # the run says it again (a small file's held-out share)
            warnings.simplefilter("ignore")
            built = build_task(task)
    except (OSError, ValueError) as e:  # ConfigError, a missing file, and the data's own one-line faults
        raise ConfigError(str(e).strip().splitlines()[0]) from None
    if getattr(built, "conversational", False) and cfg.model.source == "synthetic":
        raise ConfigError(f"task.path={task.path} holds conversational prompts (lists of messages), which need a chat "
                          "template, and the embedded model has none: use model.name=<a checkpoint with one>, or text "
                          "prompts")


def _check_writable(path: Path, key: str) -> None:
    """Refuse a folder, set by `key`, that cannot be written (before Hydra creates the run dir)."""
    try:
        check_writable(path)
    except OSError as e:
        raise ConfigError(os_error_line(e, key)) from None


class _Unread:
    """A console stream whose reader may go away (`| head -1`): from then on it writes to /dev/null,
    so that a run does not fail for want of an audience (a BrokenPipeError at any print)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._stream.fileno())  # what is still buffered goes there too
        os.close(null)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def tolerate_closed_pipes() -> None:
    """Make stdout and stderr survive a reader that exits early; every command calls it first."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Unread):
            setattr(sys, name, _Unread(stream))


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def first_line(e: BaseException) -> str:
    """An exception's message's first line (its type's name when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@contextmanager
def one_line_errors(path_key: str, interrupted: str):
    """A command's expected faults as one `error:` line and a non-zero exit: Ctrl-C (130, saying
    `interrupted`), a storage fault naming `path_key`, the setting that chose the path, or any
    ValueError or RuntimeError (1)."""
    try:
        yield
    except KeyboardInterrupt:
        fail(interrupted, code=130)
    except OSError as e:
        fail(os_error_line(e, path_key) or f"{type(e).__name__}: {first_line(e)}", code=1)
    except (ValueError, RuntimeError) as e:
        fail(f"{type(e).__name__}: {first_line(e)}", code=1)
