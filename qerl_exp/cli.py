"""The command line of `python -m qerl_exp` (and the sweep command's overrides): Hydra's options and
the overrides read in any order (`split_command_line`, `parse_command_line`: `--config-dir DIR` as
the search-path override it amounts to), and every job of a command validated before Hydra starts
(`validate`: each job composed by `compose.compose`, then what it needs of the machine and its
files, `preflight`). Hydra reports a bad override as a multi-line message or a traceback; here any
failure is one line that says what to change.

The run's task is checked here too (`check_task`), so that no step fails on a problem, a reward
function or a chat template it could have refused: the sources and the chat template file exist, the chat
template is Jinja that parses, the reward functions import and take the columns of the training and
the held-out rows alike, the data is read whole (every bad line named by file and line; a hub data
set too, so that a hub id that is not there is named before the run), each problem is written in
characters the embedded model's tokenizer has, and the longest prompt, rendered as the run renders
it (the chat template with its variables and the system prompt), plus the completion cap fits the
model's positions. Where the tokenizer and the positions are known without loading the model: the
embedded model, a local checkpoint folder (itself checked whole: `pretrained.check_folder`), whose
template must render every prompt to text.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
import warnings
from pathlib import Path

from qerl_exp.config import Config, ConfigError, as_dict, from_dict
from qerl_exp.config.compose import (check_hydra_overrides, compose, expand_sweep, group_options, search_dirs,
                                     with_search_path)
from qerl_exp.config.history import unknown_key_line
from qerl_exp.run import rundir
from qerl_exp.run.console import UsageError
from qerl_exp.run.files import check_writable, os_error_line
from qerl_exp.run.logs import quiet
from qerl_exp.run.record import RecordError, current, read_config
from qerl_exp.run.rundir import RunDirError


class Refused(UsageError):
    """A run directory the run cannot use (a finished run, another config, other runs in it): refused
    before Hydra starts, with the exit status the run's own refusal has (1)."""


def parse_command_line(argv: list[str]) -> tuple[list[str], argparse.Namespace]:
    """The command line as Hydra reads it (its own parser, options and overrides in any order:
    `split_command_line`): the overrides, `--config-dir DIR` among them as the `hydra.searchpath`
    entry it adds, and the options.

    Raises:
        UsageError: an option Hydra would refuse, or a `--config-dir` that is not a folder.
    """
    from hydra._internal.utils import get_args_parser

    options, overrides = split_command_line(argv)
    args = get_args_parser().parse_args(options)  # checked by split_command_line
    if args.config_dir:
        folder = Path(args.config_dir).expanduser().absolute()
        if not folder.is_dir():
            raise UsageError(f"--config-dir={args.config_dir} is not a folder; give the folder that holds your "
                             "preset groups (e.g. DIR/task/mine.yaml)")
        overrides = with_search_path(overrides, [f"file://{folder}"])
    return overrides, args


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


def _yaml_slip(exc: BaseException) -> str | None:
    """One line naming the file, line and column of a YAML syntax error behind `exc` (a preset's)."""
    import yaml

    while exc is not None:
        if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
            mark = exc.problem_mark
            return (f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: {exc.problem or exc.context} "
                    "(YAML cannot read it); fix that line")
        exc = exc.__cause__ or exc.__context__
    return None


def _explain(exc: BaseException, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """One line for a Hydra/OmegaConf composition error."""
    slip = _yaml_slip(exc)
    if slip:
        return slip
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


def validate(overrides: list[str], multirun: bool, check_machine: bool = True) -> list[Config]:
    """Compose and validate every job's config, before any job runs; with `check_machine`, check
    also what each job needs of the machine and its files (`preflight`).

    Raises:
        UsageError: one line on the first bad override or value, or several jobs naming one run_dir.
        Refused: a job's run_dir cannot be used (a finished run, other runs in it, ...).
    """
    jobs = _parse(overrides, multirun)
    configs = []
    for job in jobs:
        try:
            check_hydra_overrides(job)
            configs.append(compose(job)[0])
            if check_machine:
                preflight(configs[-1])
        except ConfigError as e:
            raise UsageError(str(e)) from None
        except (RecordError, RunDirError) as e:
            raise Refused(str(e)) from None
        except Exception as e:  # noqa: BLE001 - Hydra/OmegaConf raise many types for bad overrides
            raise UsageError(_explain(e, job)) from None
    named = [c.resume or c.run_dir for c in configs if c.resume or c.run_dir]
    shared = next((d for d in named if named.count(d) > 1), None)
    if shared:
        key = "resume" if any(c.resume == shared for c in configs) else "run_dir"
        raise UsageError(f"{key}={shared} names one directory for {named.count(shared)} jobs of the multirun; "
                         f"drop {key}= (each job gets its own under hydra.sweep.dir) or give each job its own ({key}=A,B)")
    return configs


def _parse(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The jobs of a command line (one without -m); a bad override is named in one line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_overrides([o])
        except Exception as e:  # noqa: BLE001 - the parser's errors are user errors
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"cannot parse the override {o!r} ({detail}); a value holding = , [ ] {{ }} ( ) ~ or "
                             f"spaces needs Hydra's quotes inside the shell's: \"key='value'\"") from None
    try:
        return expand_sweep(overrides) if multirun else [overrides]
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"cannot parse the overrides: {str(e).strip().splitlines()[0]}") from None


# Hydra's options that take a value (`--info` takes one of its choices, or none).
_VALUED = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
           "--experimental-rerun")
_INFO = ("--info", "-i")
_INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def split_command_line(args: list[str]) -> tuple[list[str], list[str]]:
    """Hydra's options and the overrides of a command line, in the order Hydra's parser needs
    (argparse takes the overrides in one piece: `train.steps=2 -m seed=0,1` would leave `seed=0,1`
    unrecognized); the options checked by that parser, a bad one named in one line.

    Returns:
        `(options, overrides)`.

    Raises:
        UsageError: an option Hydra does not know, or without its value.
    """
    from hydra._internal.utils import get_args_parser

    options, overrides, i = [], [], 0
    while i < len(args):
        arg = args[i]
        takes = arg in _VALUED or (arg in _INFO and i + 1 < len(args) and args[i + 1] in _INFO_CHOICES)
        if arg.startswith("-") and takes and i + 1 < len(args):
            options += args[i:i + 2]
            i += 2
            continue
        (options if arg.startswith("-") else overrides).append(arg)
        i += 1
    parser = get_args_parser()

    def refuse(message: str) -> None:
        raise UsageError(f"{message}; see python -m qerl_exp --help")

    parser.error = refuse  # argparse prints its usage and exits; the whole report is one line
    parsed = parser.parse_args(options)
    if parsed.config_name or parsed.config_path:
        refuse("--config-name and --config-path are not taken: a run is composed from conf/config.yaml and the "
               "presets of its groups; choose presets and overrides instead")
    return options, overrides


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
    from qerl_exp.tasks import reader

    for key, fmt in (("quant.format", cfg.quant.format), ("rollout.quant", cfg.rollout.quant)):
        if fmt == "nf4":
            try:
                with quiet(cfg.verbose):
                    import bitsandbytes  # noqa: F401
            except Exception as e:  # noqa: BLE001 - a broken install raises more than ImportError
                raise ConfigError(f"{key}=nf4 needs bitsandbytes, which does not import here ({type(e).__name__}); "
                                  "pip install bitsandbytes, or choose quant=nvfp4") from None
    if cfg.resume and not (Path(cfg.resume) / "config.json").is_file():
        raise ConfigError(f"resume={cfg.resume} is not a run directory (no config.json in it)")
    # a resume runs its saved config (one line naming config.json when it is not JSON or does not fit)
    run_cfg = from_dict(current(read_config(cfg.resume), Path(cfg.resume) / "config.json")) if cfg.resume else cfg
    for key, path in (("task.path", run_cfg.task.path), ("task.eval_path", run_cfg.task.eval_path)):
        if path and reader.missing(path, key):
            raise ConfigError(f"{key}={path}, the run's data, does not exist; restore that file" if cfg.resume else
                              reader.missing(path, key))
    if cfg.resume and cfg.run_dir and Path(cfg.run_dir).absolute() != Path(cfg.resume).absolute():
        raise ConfigError(f"resume={cfg.resume} continues that run in its own directory, but run_dir={cfg.run_dir} "
                          "names another; drop run_dir=")
    for key, path in (("run_dir", cfg.run_dir), ("resume", cfg.resume)):
        if path and Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"{key}={path} is a file, not a directory; choose another {key}")
    if cfg.resume or cfg.run_dir:  # what the run's claim would refuse, before Hydra starts
        from qerl_exp.run.run_files import comparable, digests  # torch: not for a command refused before

        target = cfg.resume or cfg.run_dir
        rundir.check(target, comparable(rundir.saved_config(target), {**as_dict(run_cfg), **digests(run_cfg)}))
    _check_writable(Path(cfg.resume or cfg.run_dir or "runs"), "run_dir")
    if (cfg.model.source == "synthetic" and cfg.model.warmup.max_steps) or cfg.model.gguf_file or cfg.model.package:
        _check_writable(Path(cfg.model.cache_dir).expanduser(), "model.cache_dir")  # where the model is cached
    if cfg.model.source == "pretrained" and cfg.model.name.startswith(("/", ".", "~")) and not Path(cfg.model.name).expanduser().is_dir():
        raise ConfigError(f"model.name={cfg.model.name} is not a directory; give a checkpoint directory or a hub id")
    if cfg.model.source == "pretrained" and not cfg.model.gguf_file and not Path(cfg.model.name).expanduser().is_dir():
        from qerl_exp.models.pretrained import check_hub_id

        try:
            check_hub_id(cfg.model.name)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    check_task(run_cfg)
    from qerl_exp.rl import optim  # torch: a config refused before this point is refused without it

    optim.check(run_cfg.train, cfg.verbose)
    _check_model(run_cfg, cfg.verbose)
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


def _check_model(cfg: Config, verbose: bool) -> None:
    """What the run needs of its model's modules, against its skeleton: an architecture its learner and
    engine read, LoRA targets peft takes (`lora_targets.check`), RMSNorms for AQN (`noise.noisy_norms`)."""
    import torch

    from qerl_exp.models import lora_targets
    from qerl_exp.rl.noise import noisy_norms

    cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    with quiet(verbose):
        model = lora_targets.skeleton(cfg)
    if model is None:  # a GGUF checkpoint: checked as it loads
        return
    with quiet(verbose):
        lora_targets.check(cfg, model, cuda)
    if cfg.noise.schedule != "none":
        try:
            noisy_norms(model, cfg.noise.include_final_norm)
        except ValueError as e:
            raise ConfigError(f"noise.schedule={cfg.noise.schedule}: {e}; use noise=none") from None


def _check_writable(path: Path, key: str) -> None:
    """Refuse a folder, set by `key`, that cannot be written (before Hydra creates the run dir)."""
    try:
        check_writable(path)
    except OSError as e:
        raise ConfigError(os_error_line(e, key)) from None


def check_task(cfg: Config, new_tokens: tuple[str, int] | None = None, model_fixed: bool = False) -> None:
    """Check the task's problems against the model (see the module docstring).

    Args:
        cfg: the run's config.
        new_tokens: the completion cap and the key that sets it; default the larger of
            `algo.max_new_tokens` and `eval.max_new_tokens`.
        model_fixed: the model is a finished run's (an evaluation): no advice to change it.

    Raises:
        ConfigError: one line naming the file and line, or the keys, and what to change.
    """
    import numpy as np

    from qerl_exp.tasks import build_task, reader, reference_completion

    spec = cfg.task
    if spec.name == "dataset" and not spec.path:
        raise ConfigError(f"task=dataset needs task.path=<{reader.SOURCES}>")
    if spec.chat_template_file and not Path(spec.chat_template_file).expanduser().is_file():
        raise ConfigError(f"task.chat_template={spec.chat_template} is neither a Jinja template (it holds no "
                          "{{ or {%) nor an existing file; give one of them")
    _check_template_syntax(spec)
    try:
        for key, value in (("path", spec.path), ("eval_path", spec.eval_path)):
            if value:
                reader.kind(value, f"task.{key}")
        with warnings.catch_warnings():  # the run says them; a refusal is one line
            warnings.simplefilter("ignore")
            task = build_task(spec)
    except (OSError, ValueError) as e:  # ConfigError, a missing file, and the data's own one-line faults
        raise ConfigError(str(e).strip().splitlines()[0]) from None
    if getattr(task, "conversational", False) and cfg.model.source == "synthetic":
        raise ConfigError(f"task.path={spec.path} holds conversational prompts (lists of messages), which need a chat "
                          "template, and the embedded model has none: use model.name=<a checkpoint with one>, or text "
                          "prompts")
    tokenizer, positions = _tokenizer(cfg)
    if tokenizer is None:
        return
    if new_tokens is None:
        new_tokens = max(("algo.max_new_tokens", cfg.algo.max_new_tokens), ("eval.max_new_tokens", cfg.eval.max_new_tokens),
                         key=lambda kv: kv[1])
    # a file's problems are all there; a generated task's: its evaluation splits and a fixed sample of its draws
    problems = list(getattr(task, "train", [])) or task.sample(256, np.random.default_rng(0))
    problems += [p for split in task.splits for p in task.eval_problems(split)]
    longest = (0, "")
    for p in problems:
        where = p.source or f"task={cfg.task.name} ({p.question[:40]!r})"
        try:
            prompt = tokenizer.render_prompt(p.prompt, cfg.task.system_prompt)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}; remove or rewrite that problem, or use a pretrained model "
                              "(model.name=...)") from None
        except Exception as e:  # noqa: BLE001 - a chat template's own faults (Jinja's, raise_exception's)
            raise ConfigError(f"the chat template ({_template_key(cfg)}) cannot render the prompt of {where} "
                              f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
                              "fix the template, or task.chat_template_kwargs") from None
        if not prompt.strip():
            raise ConfigError(f"the chat template ({_template_key(cfg)}) renders the prompt of {where} as empty text: the "
                              "model would see none of it; fix the template")
        try:
            n = 1 + len(tokenizer.encode(prompt))
            if cfg.model.source == "synthetic":  # its warm-up learns the worked answer too
                tokenizer.encode(reference_completion(p))
        except ValueError as e:
            raise ConfigError(f"{where}: {e}; remove or rewrite that problem, or use a pretrained model "
                              "(model.name=...)") from None
        longest = max(longest, (n, where))
    key, cap = new_tokens
    synthetic = cfg.model.source == "synthetic"  # its prompts are the questions alone
    more = "" if model_fixed else " or raise model.max_positions" if synthetic else " or use a model with more positions"
    if positions and longest[0] >= positions:
        raise ConfigError(f"the task's longest prompt ({longest[0]} tokens{'' if synthetic else ' as the chat template renders it with task.system_prompt'}, "
                          f"{longest[1]}) leaves no room in the model's {positions} positions; "
                          + ("raise model.max_positions" if synthetic else
                             f"shorten task.system_prompt (task.system_prompt='' sends none)"
                             f"{' or task.chat_template' if cfg.task.chat_template else ''}{more}"))
    if positions and longest[0] + cap > positions:
        raise ConfigError(f"{key}={cap} and the task's longest prompt ({longest[0]} tokens, {longest[1]}) exceed the "
                          f"model's {positions} positions; lower {key} to at most {positions - longest[0]}{more}")


def _template_key(cfg: Config) -> str:
    return f"task.chat_template={cfg.task.chat_template[:60]!r}" if cfg.task.chat_template else \
        f"the checkpoint's own, with task.chat_template_kwargs={dict(cfg.task.chat_template_kwargs)}"


def _check_template_syntax(spec) -> None:
    """Refuse a `task.chat_template` that Jinja cannot parse, naming its line (whatever the model:
    a hub checkpoint's tokenizer is not here before the run)."""
    if not spec.chat_template:
        return
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from qerl_exp.models import chat_template_text

    try:  # as transformers compiles a chat template
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"]).from_string(chat_template_text(spec))
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"task.chat_template={spec.chat_template[:60]!r} is not a Jinja template Jinja can read "
                          f"(line {e.lineno}: {e.message}); fix it") from None


def _tokenizer(cfg: Config):
    """The run's tokenizer, with the task's chat settings, and its model's positions, where they are
    known before the model loads: the embedded model's; a local checkpoint folder's (checked whole:
    `pretrained.check_folder`). `(None, None)` otherwise (a hub id, a GGUF file)."""
    if cfg.model.source == "synthetic":
        from qerl_exp.models.tokenizers import CharTokenizer

        tokenizer = CharTokenizer()
        if 0 < cfg.model.vocab_size < len(tokenizer):
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is below the embedded tokenizer's {len(tokenizer)} "
                              "tokens; give at least that many, or 0 (the tokenizer's)")
        return tokenizer, cfg.model.max_positions
    folder = Path(cfg.model.name).expanduser()
    if cfg.model.gguf_file or not folder.is_dir():
        return None, None
    from qerl_exp.models import chat_template_text
    from qerl_exp.models.pretrained import check_folder
    from qerl_exp.models.tokenizers import HFTokenizer

    try:
        positions = check_folder(folder)
        with quiet(cfg.verbose):
            tokenizer = HFTokenizer(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from None
    tokenizer.use_chat(chat_template_text(cfg.task), cfg.task.chat_template_kwargs)
    return tokenizer, positions
