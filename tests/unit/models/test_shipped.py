"""The embedded bases the package ships: each matches its record by digest, the default config starts
from the shipped default base, and the warm-up command ships what it warmed up."""

from __future__ import annotations

import json

import pytest

from qerl_exp.config.compose import compose
from qerl_exp.models import shipped, warmup
from qerl_exp.models.tokenizers import CharTokenizer
from qerl_exp.tasks import build_task

FOLDERS = sorted(shipped.BASES.glob("tiny-*"))


def test_the_package_ships_the_default_base():
    assert FOLDERS, "no embedded base ships with the package: python -m qerl_exp.models.warmup ship=true"


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_a_shipped_base_is_what_its_record_describes(folder):
    """By digest, not by warming it up again (another kind of CPU would make another model)."""
    record = json.loads((folder / shipped.RECORD).read_text())
    assert shipped.sha256(folder / "model.safetensors") == record["weights_sha256"]
    assert warmup.spec_key(record["spec"]) == record["key"] == folder.name.removeprefix("tiny-")
    assert json.loads((folder / "warmup.json").read_text())["steps"] == record["warmup_steps"]
    assert not record["commit"].endswith("-dirty") and len(record["commit"]) == 40
    assert record["command"].startswith("python -m qerl_exp.models.warmup") and "ship=true" in record["command"]


def test_the_default_config_starts_from_the_shipped_base(tmp_path):
    cfg = compose([f"model.cache_dir={tmp_path}"])[0]
    task, tok = build_task(cfg.task), CharTokenizer()
    spec = warmup.base_spec(cfg.model, cfg.task, task, tok)
    folder = shipped.find(warmup.spec_key(spec))
    assert folder is not None and json.loads((folder / shipped.RECORD).read_text())["spec"] == spec
    _, info = warmup.load_or_warm_up(cfg.model, cfg.task, task, tok)
    assert info["path"] == str(folder) and info["weights"] == shipped.sha256(folder / "model.safetensors")[:16]
    assert not any(tmp_path.iterdir())  # nothing warmed up, nothing cached


def test_the_warmup_command_ships_what_it_warmed_up(tmp_path, monkeypatch):
    cfg = compose([f"model.cache_dir={tmp_path / 'cache'}", "model.warmup.max_steps=2"])[0]
    task, tok = build_task(cfg.task), CharTokenizer()
    _, info = warmup.load_or_warm_up(cfg.model, cfg.task, task, tok)
    spec = warmup.base_spec(cfg.model, cfg.task, task, tok)
    out = shipped.ship(tmp_path / "cache" / f"tiny-{info['cache_key']}", spec, info["cache_key"], "c" * 40,
                       "python -m qerl_exp.models.warmup model.warmup.max_steps=2 ship=true", root=tmp_path / "bases")
    record = json.loads((out / shipped.RECORD).read_text())
    assert record["weights_sha256"] == shipped.sha256(out / "model.safetensors") and record["warmup_steps"] == 2
    assert shipped.find(info["cache_key"], tmp_path / "bases") == out
    monkeypatch.setattr(shipped, "BASES", tmp_path / "bases")  # the run now starts from the shipped copy
    _, again = warmup.load_or_warm_up(cfg.model, cfg.task, task, tok)
    assert again["path"] == str(out) and again["weights"] == info["weights"]
