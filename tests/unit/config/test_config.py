"""Config schemas, presets and the one-line errors of the command line."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import fields

import pytest
import yaml

from conftest import ROOT, qerl
from qerl_exp.cli import validate
from qerl_exp.config import GROUPS, Config, ConfigError, as_dict, from_dict
from qerl_exp.config.compose import compose, group_options
from qerl_exp.flat_config import field_docs, flat_yaml
from qerl_exp.run.console import UsageError


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_preset_composes_into_valid_dataclasses(group):
    for preset in group_options(group):
        # the checkpoint preset loads what model.name names
        named = ["model.name=/some/checkpoint"] if (group, preset) == ("model", "checkpoint") else []
        cfg = compose([f"{group}={preset}", *named])[0]
        assert isinstance(cfg, Config)


def test_presets_set_what_they_say():
    cfg = compose(["quant=nf4_dq", "algo=dapo", "noise=exp", "lora=r32"])[0]
    assert (cfg.quant.format, cfg.quant.double_quant) == ("nf4", True)
    assert (cfg.algo.loss_type, cfg.algo.eps_high, cfg.algo.filter_zero_std) == ("dapo", 0.28, True)
    assert cfg.algo.mask_truncated_completions and compose(["algo=grpo"])[0].algo.loss_type == "grpo"
    assert (cfg.noise.schedule, cfg.noise.num_stages) == ("exp", 10)
    assert (cfg.lora.r, cfg.lora.alpha) == (32, 32)
    # eps_high follows eps_low unless set (TRL's epsilon_high); config.json records the number
    assert compose(["algo.eps_low=0.3"])[0].algo.eps_high == 0.3
    assert compose(["algo.eps_low=0.3", "algo.eps_high=0.25"])[0].algo.eps_high == 0.25
    assert compose(["algo=dapo", "algo.eps_low=0.1"])[0].algo.eps_high == 0.28
    assert as_dict(compose([])[0])["algo"]["eps_high"] == 0.2


def test_compose_gives_the_config_and_every_group_choice():
    cfg, choices = compose(["strategy=nvfp4_lora", "hydra.run.dir=/elsewhere"])  # hydra.* is Hydra's own
    assert cfg.quant.format == "nvfp4" and cfg.noise.schedule == "exp"
    assert list(choices.items()) == [("model", "tiny"), ("quant", "nvfp4"), ("lora", "r16"), ("noise", "exp"),
                                     ("task", "arith"), ("algo", "grpo"), ("tracker", "offline"), ("strategy", "nvfp4_lora")]
    assert "strategy" not in compose([])[1]


def test_model_source_names_what_the_model_is():
    """Synthetic presets are labelled by what they build; `auto` loads any name but `tiny`."""
    sources = {preset: (cfg.model.source, cfg.model.name) for preset in group_options("model") if preset != "checkpoint"
               for cfg in [compose([f"model={preset}"])[0]]}
    assert sources["tiny"] == ("synthetic", "tiny")
    assert sources["qwen2.5-7b-shape"] == ("synthetic", "qwen2.5-7b-shape")
    assert sources["smollm2-135m"] == ("pretrained", "SmolLM2-135M-Instruct")
    assert {s for p, (s, _) in sources.items() if p.endswith("-shape") or p == "tiny"} == {"synthetic"}
    assert {s for p, (s, _) in sources.items() if not (p.endswith("-shape") or p == "tiny")} == {"pretrained"}
    assert compose(["model.name=/some/checkpoint"])[0].model.source == "pretrained"
    assert compose(["model=qwen2.5-7b-shape", "model.num_layers=2"])[0].model.source == "synthetic"


def test_a_checkpoint_by_name_takes_the_checkpoint_preset_and_keeps_every_value_given(tmp_path):
    """`model.name=<folder>` on the default model preset composes on the `checkpoint` preset: the
    schema's settings for a real model, and every value a preset or the command line gives, as is."""
    cfg, choices = compose(["model.name=/some/checkpoint"])
    assert choices["model"] == "checkpoint" and cfg.model.source == "pretrained"
    assert (cfg.train.lr, cfg.algo.max_new_tokens, cfg.monitor.every) == (1e-5, 1024, 0)
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "short.yaml").write_text("# @package _global_\ntrain:\n  lr: 2e-3\nalgo:\n  max_new_tokens: 32\n")
    mine = [f"hydra.searchpath=[file://{tmp_path}]", "task=short", "model.name=/some/checkpoint"]
    cfg, choices = compose(mine)
    assert choices["model"] == "checkpoint" and (cfg.train.lr, cfg.algo.max_new_tokens) == (2e-3, 32)
    # a value equal to the embedded model's, given on the command line or by a chosen model preset, stays
    assert compose(["model.name=/some/checkpoint", "monitor.every=1"])[0].monitor.every == 1
    cfg, choices = compose(["model=tiny", "model.name=/some/checkpoint"])
    assert choices["model"] == "tiny" and cfg.train.lr == 2e-3
    assert compose([])[1]["model"] == "tiny" and compose(["model.source=synthetic", "model.name=x"])[1]["model"] == "tiny"


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


def _as_saved_by_an_earlier_version(saved: dict) -> dict:
    """`saved` as the version before TRL's loss names wrote it: `algo.loss_agg`, a boolean
    `algo.scale_rewards`, none of the fields added with them."""
    old = {**saved, "algo": dict(saved["algo"]), "noise": dict(saved["noise"])}
    loss_type = old["algo"].pop("loss_type")
    old["algo"]["loss_agg"] = {"grpo": "sequence", "dapo": "token"}[loss_type]
    old["algo"]["scale_rewards"] = old["algo"]["scale_rewards"] == "group"
    for key in ("importance_sampling_level", "mask_truncated_completions", "top_k", "min_p", "stop"):
        del old["algo"][key]
    del old["noise"]["target_relative"]
    return old


@pytest.mark.parametrize("overrides", [["algo=grpo"], ["algo=dapo", "algo.mask_truncated_completions=false"],
                                       ["algo.scale_rewards=none", "noise=fixed"]])
def test_a_config_saved_with_the_retired_algo_keys_means_what_it_meant(overrides, tmp_path):
    from qerl_exp.run.rundir import check_checkpoint, claim

    cfg, choices = compose(overrides)
    old = _as_saved_by_an_earlier_version(as_dict(cfg))
    assert from_dict(old) == cfg
    # a run started by the earlier version continues: its config.json and checkpoints compare equal
    config = {**as_dict(cfg), "choices": choices, "world_size": 1, "commit": "abc"}
    (tmp_path / "config.json").write_text(json.dumps({**old, "choices": choices, "world_size": 1, "commit": "abc"}))
    claim(tmp_path, config).release()
    check_checkpoint(tmp_path / "checkpoints" / "step_000002", old, config)
    assert json.loads((tmp_path / "config.json").read_text())["algo"]["loss_type"] == cfg.algo.loss_type  # its meaning kept


def test_an_adaptive_run_saved_before_relative_targets_keeps_its_set_point_in_nats():
    cfg = compose(["noise=adaptive", "noise.target_relative=false", "noise.target_value=0.5"])[0]
    assert from_dict(_as_saved_by_an_earlier_version(as_dict(cfg))) == cfg


def test_a_checkpoint_by_name_gets_the_schema_defaults_not_the_embedded_models():
    tiny = compose([])[0]
    assert (tiny.train.lr, tiny.algo.max_new_tokens, tiny.monitor.every) == (2e-3, 32, 1)
    by_name = compose(["model.name=/some/checkpoint"])[0]
    schema = Config()
    want = (schema.train.lr, schema.algo.max_new_tokens, schema.monitor.every)
    assert want == (1e-5, 1024, 0)
    assert (by_name.train.lr, by_name.algo.max_new_tokens, by_name.monitor.every) == want
    preset = compose(["model=qwen2.5-7b"])[0]
    assert (preset.train.lr, preset.algo.max_new_tokens, preset.monitor.every) == want
    # what the command line or another preset sets stays
    mine = compose(["model.name=/some/checkpoint", "train.lr=2e-3", "monitor.every=5"])[0]
    assert (mine.train.lr, mine.algo.max_new_tokens, mine.monitor.every) == (2e-3, 1024, 5)
    smol = compose(["model=smollm2-135m"])[0]
    assert (smol.train.lr, smol.algo.max_new_tokens, smol.monitor.every) == (5e-4, 128, 0)
    assert compose(["model.name=tiny-label", "model.source=synthetic"])[0].train.lr == 2e-3  # the embedded model


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
        (["model.family=gpt2"], "model.family='gpt2' is not valid; choose one of: llama, qwen2, qwen3"),
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
        (["algo.loss_type=bogus"], "algo.loss_type='bogus' is not valid; choose one of: grpo, dr_grpo, dapo, bnpo"),
        (["algo.loss_agg=token"], "algo.loss_agg is retired; set algo.loss_type: grpo (was sequence), dapo (was token)"),
        (["algo.scale_rewards=true"], "algo.scale_rewards takes group, batch or none now (the boolean's true was group"),
        (["algo.importance_sampling_level=seq"], "algo.importance_sampling_level='seq' is not valid; choose one of: token, sequence"),
        (["algo.top_k=-1"], "algo.top_k must be >= 0"),
        (["algo.min_p=1"], "algo.min_p must be in [0, 1)"),
        (["algo.stop=['']"], "algo.stop entries must be non-empty strings"),
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


@pytest.mark.slow
def test_the_run_records_the_config_that_validation_composed(tmp_path):
    # the command line is composed twice: by `validate` before Hydra starts (so that a refused
    # command writes nothing) and by Hydra for the run; both must give one config
    overrides = ["strategy=nvfp4_lora", "noise=exp", "train.lr=3e-3", "algo.stop=[STOP]",
                 "train.steps=1", "train.prompts_per_step=2", "algo.group_size=2", "algo.max_new_tokens=8",
                 "monitor.every=0", "tracker=disabled", f"run_dir={tmp_path / 'run'}"]
    composed = as_dict(validate(overrides, multirun=False)[0])
    out = qerl(*overrides)
    assert out.returncode == 0, out.stderr[-2000:]
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert {k: recorded[k] for k in composed} == composed


def test_trls_names_map_onto_keys_of_the_schema_as_docs_trl_md_shows():
    import dataclasses as dc

    from peft import LoraConfig as PeftLoraConfig
    from trl import GRPOConfig

    from qerl_exp.config.trl_names import TRL_NAMES

    theirs = {f.name for f in dc.fields(GRPOConfig)} | {f.name for f in dc.fields(PeftLoraConfig)}
    assert set(TRL_NAMES) <= theirs, set(TRL_NAMES) - theirs  # every name is TRL's (or peft's)
    def keys(cls, prefix=""):  # every field's dotted key, dict fields included (flatten drops empty ones)
        for f in dc.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            yield from keys(hint, f"{prefix}{f.name}.") if dc.is_dataclass(hint) else [f"{prefix}{f.name}"]

    assert {key for key, _ in TRL_NAMES.values()} <= set(keys(Config))  # and each key is the harness's
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| (.*) \|$", (ROOT / "docs" / "trl.md").read_text(), re.MULTILINE)
    assert {name: (key, "" if how == "the same" else how) for name, key, how in rows} == TRL_NAMES
