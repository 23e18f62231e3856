"""Config schemas, presets and the one-line errors of the command line."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import fields

import pytest
import yaml

from conftest import ROOT, qerl
from qerl_exp.cli import UsageError, compose, group_options, validate
from qerl_exp.config import GROUPS, Config, ConfigError, as_dict, from_dict
from qerl_exp.flat_config import field_docs, flat_yaml


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_preset_composes_into_valid_dataclasses(group):
    for preset in group_options(group):
        cfg = compose([f"{group}={preset}"])[0]
        assert isinstance(cfg, Config)


def test_presets_set_what_they_say():
    cfg = compose(["quant=nf4_dq", "algo=dapo", "noise=exp", "lora=r32"])[0]
    assert (cfg.quant.format, cfg.quant.double_quant) == ("nf4", True)
    assert (cfg.algo.loss_agg, cfg.algo.eps_high, cfg.algo.filter_zero_std) == ("token", 0.28, True)
    assert (cfg.noise.schedule, cfg.noise.num_stages) == ("exp", 10)
    assert (cfg.lora.r, cfg.lora.alpha) == (32, 32)


def test_compose_gives_the_config_and_every_group_choice():
    cfg, choices = compose(["strategy=nvfp4_lora", "hydra.run.dir=/elsewhere"])  # hydra.* is Hydra's own
    assert cfg.quant.format == "nvfp4" and cfg.noise.schedule == "exp"
    assert list(choices.items()) == [("model", "tiny"), ("quant", "nvfp4"), ("lora", "r16"), ("noise", "exp"),
                                     ("task", "arith"), ("algo", "grpo"), ("tracker", "offline"), ("strategy", "nvfp4_lora")]
    assert "strategy" not in compose([])[1]


def test_model_source_names_what_the_model_is():
    """Synthetic presets are labelled by what they build; `auto` loads any name but `tiny`."""
    sources = {preset: (cfg.model.source, cfg.model.name)
               for preset in group_options("model") for cfg in [compose([f"model={preset}"])[0]]}
    assert sources["tiny"] == ("synthetic", "tiny")
    assert sources["qwen2.5-7b-shape"] == ("synthetic", "qwen2.5-7b-shape")
    assert sources["smollm2-135m"] == ("pretrained", "SmolLM2-135M-Instruct")
    assert {s for p, (s, _) in sources.items() if p.endswith("-shape") or p == "tiny"} == {"synthetic"}
    assert {s for p, (s, _) in sources.items() if not (p.endswith("-shape") or p == "tiny")} == {"pretrained"}
    assert compose(["model.name=/some/checkpoint"])[0].model.source == "pretrained"
    assert compose(["model=qwen2.5-7b-shape", "model.num_layers=2"])[0].model.source == "synthetic"


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


def _schemas(schema=Config) -> list[type]:
    """Every config dataclass reachable from the root, the root included."""
    found = [schema]
    for f in fields(schema):
        default = getattr(schema(), f.name)
        if dataclasses.is_dataclass(default):
            found += _schemas(type(default))
    return found


def test_schema_fields_are_documented():
    """Every field of every config dataclass has an entry in its class docstring's Args block."""
    schemas = _schemas()
    assert len(schemas) == len(set(schemas)) >= 14
    for schema in schemas:
        docs = field_docs(schema)
        for f in fields(schema):
            assert docs.get(f.name), f"{schema.__name__}.{f.name} is undocumented"


def test_flat_yaml_is_generated_from_the_schemas():
    committed = (ROOT / "conf" / "flat.yaml").read_text()
    assert committed == flat_yaml(), "conf/flat.yaml is stale: python -m qerl_exp.flat_config > conf/flat.yaml"
    assert yaml.safe_load(committed) == as_dict(Config())


def test_a_saved_config_reads_back_and_an_unknown_key_is_refused():
    cfg, _ = compose(["train.steps=7", "train.fused_ops=false"])
    saved = as_dict(cfg)
    assert from_dict(saved) == cfg
    saved["train"]["compiled"] = True
    with pytest.raises(Exception, match="compiled"):
        from_dict(saved)


def test_configs_are_read_only_once_validated():
    cfg = compose(["train.steps=3"])[0]
    with pytest.raises(dataclasses.FrozenInstanceError, match="dataclasses.replace"):
        cfg.train.steps = 5
    assert dataclasses.replace(cfg.train, steps=7).steps == 7 and cfg.train.steps == 3
    with pytest.raises(ConfigError, match="train.steps must be >= 1"):
        dataclasses.replace(cfg.train, steps=0)


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
        (["lora.r=0"], "lora.r must be >= 1"),
        (["lora.dropout=1.5"], "lora.dropout must be in [0, 1)"),
        (["algo.temperature=0"], "algo.temperature must be > 0"),
        (["algo.top_p=0"], "algo.top_p must be in (0, 1]"),
        (["train.lr=-1e-5"], "train.lr must be > 0"),
        (["train.warmup_ratio=1.0"], "train.warmup_ratio must be in [0, 1)"),
        (["noise=exp", "noise.sigma_start=0"], "noise.schedule=exp needs sigma_start and sigma_end > 0"),
        (["noise.num_stages=1"], "noise.num_stages must be >= 2"),
        (["checkpoint.keep=0"], "checkpoint.keep must be >= 1"),
        (["monitor.every=-1"], "monitor.every must be >= 0"),
        (["model.family=gpt2"], "model.family='gpt2' is not valid; choose one of: qwen2, llama"),
        (["model.source=hub"], "model.source='hub' is not valid; choose one of: auto, synthetic, pretrained"),
        (["model.source=pretrained"], "model.source=pretrained needs model.name=<a hub id or checkpoint folder>"),
        (["model=qwen2.5-7b-shape", "model.gguf_file=m.gguf"], "model.gguf_file needs model.source=pretrained"),
        (["rollout.engine=vllm"], "rollout.engine='vllm' is not valid; choose one of: auto, hf, fast"),
        (["rollout.engine=fast"], "rollout.engine=fast needs a CUDA device"),
        (["quant=bf16", "quant.double_quant=true"], "quant.double_quant applies only to quant.format=nf4"),
        (["task=gsm8k", "task.path=/no/such/file.jsonl"], "task.path=/no/such/file.jsonl does not exist"),
        (["resume=/no/such/run"], "resume=/no/such/run is not a run directory"),
        (["model.name=/no/such/checkpoint"], "model.name=/no/such/checkpoint is not a directory"),
        (["eval.k=-1"], "eval.k must be >= 2 for sampled pass@k"),
        (["algo.beta=-0.1"], "algo.beta must be >= 0"),
        (["seed=abc"], "bad value for 'seed'"),
        (["+bogus=1", "train.steps=2"], "unknown config key 'bogus'"),
        (["+train.foo=2"], "unknown config key 'train.foo'"),
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


def test_cli_bad_choice_exits_nonzero_with_one_line():
    out = qerl("quant=bogus", timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == ["error: quant=bogus is not a preset; choose one of: bf16, mxfp4, nf4, nf4_dq, nvfp4"]
    assert "Traceback" not in out.stderr
