"""Config schemas, presets and the one-line errors of the command line."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

from conftest import ROOT, qerl
from qerl_exp.cli import UsageError, compose_config, group_options, validate
from qerl_exp.config import GROUPS, Config, ConfigError, to_config


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_preset_composes_into_valid_dataclasses(group):
    for preset in group_options(group):
        cfg = to_config(compose_config([f"{group}={preset}"]))
        assert isinstance(cfg, Config)


def test_presets_set_what_they_say():
    cfg = to_config(compose_config(["quant=nf4_dq", "algo=dapo", "noise=exp", "lora=r32"]))
    assert (cfg.quant.format, cfg.quant.double_quant) == ("nf4", True)
    assert (cfg.algo.loss_agg, cfg.algo.eps_high, cfg.algo.filter_zero_std) == ("token", 0.28, True)
    assert (cfg.noise.schedule, cfg.noise.num_stages) == ("exp", 10)
    assert (cfg.lora.r, cfg.lora.alpha) == (32, 32)


def test_yaml_presets_comment_every_field():
    """verl's rule: a comment line directly above every field of every preset."""
    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"^\s*[A-Za-z_][\w.]*:\s*\S", line) or re.match(r"^\s*[A-Za-z_][\w.]*:\s*$", line):
                above = lines[i - 1].strip() if i else ""
                assert above.startswith("#") or line.strip() in ("defaults:", "hydra:", "run:", "sweep:", "job:", "train:") or above.endswith(":"), (
                    f"{path.relative_to(ROOT)}:{i + 1} field without a comment above: {line!r}"
                )


def test_schema_fields_are_documented():
    """Every dataclass field has an entry in its class docstring's Args block."""
    for schema in [Config, *GROUPS.values()]:
        for f in fields(schema):
            assert f"{f.name}:" in (schema.__doc__ or ""), f"{schema.__name__}.{f.name} is undocumented"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["quant=bogus"], "quant=bogus is not a preset; choose one of: bf16, mxfp4, nf4, nf4_dq, nvfp4"),
        (["noise=loud"], "noise=loud is not a preset; choose one of"),
        (["train.stepz=3"], "unknown config key 'train.stepz'"),
        (["train.steps=abc"], "bad value for 'train.steps'"),
        (["train.steps=0"], "train.steps must be >= 1"),
        (["algo.group_size=1"], "algo.group_size must be >= 2"),
        (["noise.sigma=-1"], "noise.sigma must be a finite number >= 0"),
        (["quant.format=int3"], "quant.format='int3' is not valid; choose one of"),
        (["tracker.mode=loud"], "tracker.mode='loud' is not valid"),
        (["model.hidden_size=100"], "model.hidden_size must be a positive multiple of 64"),
    ],
)
def test_bad_overrides_give_one_line(overrides, message):
    with pytest.raises(UsageError) as err:
        validate(overrides, multirun=False)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_multirun_validates_every_job():
    validate(["noise=adaptive,fixed"], multirun=True)
    with pytest.raises(UsageError, match="noise=bogus is not a preset"):
        validate(["noise=fixed,bogus"], multirun=True)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_cli_bad_choice_exits_nonzero_with_one_line():
    out = qerl("quant=bogus", timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == ["error: quant=bogus is not a preset; choose one of: bf16, mxfp4, nf4, nf4_dq, nvfp4"]
    assert "Traceback" not in out.stderr
