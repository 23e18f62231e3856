"""How a run's config is made: `compose(overrides)`, Hydra's composition of `conf/config.yaml`
with the overrides, validated into the schema's dataclasses (`config_of`), the one way every command,
Hydra's entry point, sweep trial and test gets `(Config, choices)`.

Presets kept outside the repository come in Hydra's own ways: `--config-dir DIR` (or
`--config-dir=DIR`, `-cd DIR`) and the override `hydra.searchpath=[file://DIR]`, both searched
after `conf/` (`search_dirs`; `cli.parse_command_line` turns `--config-dir` into the search-path
override it amounts to). Hydra takes a preset from the first folder of its search path that has
it, so a preset of such a folder named like one of `conf/` would never be used: it is refused
(`check_own_presets`).

The `model` group's default preset is the embedded model's (`tiny`), which also sets what that model
was tuned with (learning rate, completion length, the monitor). A composition that names a checkpoint
(`model.name` other than `tiny`, not synthetic) on that default, with no `model=` override, is
composed again on the `checkpoint` preset (`select_presets`): Hydra's composition is then the run's
config, and `--cfg job` prints it (`cli` hands Hydra the same preset).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import hydra
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, open_dict

from qerl_exp.config import GROUPS, Config, ConfigError, as_dict, flatten, register_configs, to_config

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

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


def check_own_presets(overrides: list[str] | tuple[str, ...]) -> None:
    """Refuse a preset of a folder of the user's (`--config-dir`, `hydra.searchpath`) named like a
    built-in one of `conf/`: Hydra finds `conf/`'s first, and would use it without a word.

    Raises:
        ConfigError: one line naming both files and what to do.
    """
    for folder in search_dirs(overrides)[1:]:
        for path in sorted(folder.rglob("*.yaml")) if folder.is_dir() else []:
            own = path.relative_to(folder)
            if (CONF_DIR / own).is_file():
                group, name = own.parent.as_posix(), own.stem
                what = f"the built-in preset {group}={name}" if group != "." else "the built-in primary config"
                raise ConfigError(f"{path} is named like {what} ({CONF_DIR / own}), which "
                                  "Hydra's search path finds first, so yours would never be used; rename it (e.g. "
                                  f"{own.with_stem(f'{name}_mine').as_posix()}) and choose it by that name")


def with_search_path(overrides: list[str], folders: list[str]) -> list[str]:
    """`overrides` whose `hydra.searchpath` override also holds `folders` (`file://` or `pkg://`
    entries), ahead of its own entries, as Hydra orders `--config-dir` and `hydra.searchpath`."""
    entries, rest = _search_path(overrides)
    entries = list(dict.fromkeys([*folders, *entries]))
    if not entries:
        return rest
    quoted = ",".join("'" + e.replace("\\", "\\\\").replace("'", "\\'") + "'" for e in entries)
    return [*rest, f"{SEARCH_PATH}=[{quoted}]"]


def search_path_of(sources) -> list[str]:
    """The `hydra.searchpath` override that rebuilds, inside a Hydra job, the search path of its
    command line (`--config-dir` and `hydra.searchpath`), from `HydraConfig.runtime.config_sources`."""
    providers = ("command-line", f"{SEARCH_PATH} in command-line")
    extra = [f"{s.schema}://{s.path}" for s in sources if s.provider in providers]
    return with_search_path([], extra)


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
        ConfigError: a value the schema rejects, or a preset of the user's named like a built-in
            one (`check_own_presets`); Hydra's and OmegaConf's errors for overrides that do not
            compose (`validate` turns both into one line).
    """
    check_own_presets(overrides)
    overrides = [o for o in overrides if not _is_hydra(o) or _is_search_path(o)]
    cfg = _compose_hydra(overrides)
    if _names_checkpoint(cfg, overrides):
        cfg = _compose_hydra([*overrides, CHECKPOINT_PRESET])
    picked = cfg.hydra.runtime.choices
    with open_dict(cfg):
        del cfg["hydra"]
    return config_of(cfg, picked)


EMBEDDED = "tiny"  # the preset of the embedded model, the default of the `model` group
CHECKPOINT_PRESET = "model=checkpoint"  # the preset of a checkpoint named by model.name on that default


def _names_checkpoint(cfg: DictConfig, overrides: list[str]) -> bool:
    """The composition `cfg` names a checkpoint (`model.name` other than the embedded model, a
    source other than synthetic) on the embedded model's preset, which no override chose."""
    chosen = any(o.partition("=")[0].lstrip("+~") == "model" for o in overrides)
    model = cfg.model
    return (not chosen and cfg.hydra.runtime.choices.get("model") == EMBEDDED and model.get("name") != EMBEDDED
            and model.get("source") != "synthetic")


def select_presets(overrides: list[str], multirun: bool = False) -> list[str]:
    """The preset choices the composition adds to `overrides` (`[CHECKPOINT_PRESET]` or none), for
    Hydra's own composition of the command line (the run and `--cfg job`), as `compose` makes it.

    Raises:
        ConfigError: the jobs of a multirun differ (the embedded model in some, a checkpoint in others).
    """
    jobs = expand_sweep(overrides) if multirun else [overrides]
    picks = {_names_checkpoint(_compose_hydra([o for o in job if not _is_hydra(o) or _is_search_path(o)]), job)
             for job in jobs}
    if len(picks) > 1:
        raise ConfigError("this multirun names the embedded model in some jobs and a checkpoint in others, which take "
                          f"other presets (model=tiny, {CHECKPOINT_PRESET}); run them as two commands")
    return [CHECKPOINT_PRESET] if picks == {True} else []


def config_of(cfg: DictConfig, picked) -> tuple[Config, dict[str, str]]:
    """The validated run config of a Hydra composition (without its `hydra` node) and its group
    choices, from `picked` (`hydra.runtime.choices`): what `compose` returns, and what Hydra's entry
    point makes of the composition Hydra hands it."""
    choices = {g: str(picked[g]) for g in (*GROUPS, "strategy") if picked.get(g) is not None}
    return to_config(cfg), choices


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


def set_keys(overrides: list[str], composed: dict[str, object]) -> set[str]:
    """The dotted config keys `overrides` set: each `key=value`, and every key a group choice changes.

    Args:
        overrides: the command line's overrides.
        composed: the flattened config they composed (`flatten(as_dict(cfg))`).

    Returns:
        Dotted keys, e.g. `{"lora.r", "train.steps"}` for `lora.r=32 train.steps=9`.
    """
    base = flatten(as_dict(compose([])[0]))
    named = [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o]
    return {k for k in composed if composed[k] != base.get(k) or any(k == n or k.startswith(n + ".") for n in named)}


