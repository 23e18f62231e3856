"""`python -m analysis wandb-report`: the W&B report builds and serialises offline; saving needs a
server, and only that part is skipped here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from analysis.wandb_report import build, spec_json
from conftest import ROOT


def _panels(spec: dict) -> list[dict]:
    grid = next(b for b in spec["spec"]["blocks"] if b.get("type") == "panel-grid")
    return grid["metadata"]["panelBankSectionConfig"]["panels"]


def _runset(spec: dict) -> dict:
    return next(b for b in spec["spec"]["blocks"] if b.get("type") == "panel-grid")["metadata"]["runSets"][0]


def _report(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analysis", "wandb-report", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def test_strategy_report_holds_the_papers_figures_as_panels():
    spec = json.loads(spec_json(build("me", "qerl-exp", "arith", "strategy")))
    assert spec["project"] == {"entity": "me", "name": "qerl-exp"} and spec["displayName"] == "qerl-exp strategies: arith"
    assert _runset(spec)["filters"]["filters"] == [
        {"key": {"section": "run", "name": "group"}, "op": "=", "value": "arith", "disabled": False}]
    shown = [(p["viewType"], p["config"].get("metrics"), p["config"].get("groupBy")) for p in _panels(spec)]
    by_strategy, by_schedule = "choices.value.strategy", "choices.value.noise"
    assert shown == [
        ("Run History Line Plot", ["reward"], by_strategy),
        ("Run History Line Plot", ["sampler/entropy"], by_strategy),
        ("Run History Line Plot", ["entropy_gain"], by_strategy),
        ("Run History Line Plot", ["quant/kl"], by_strategy),
        ("Run History Line Plot", ["noise/sigma"], by_schedule),
        ("Bar Chart", ["mem/peak_bytes", "mem/weights_bytes"], by_strategy),
        ("Bar Chart", ["perf/rollout_tok_s"], by_strategy),
        ("Bar Chart", ["perf/step_s"], by_strategy),
    ]
    curves = [p["config"] for p in _panels(spec) if p["viewType"] == "Run History Line Plot"]
    assert all(c["xAxis"] == "step" and c["groupAgg"] == "mean" and c["groupArea"] == "stddev" for c in curves)
    assert curves[-1].get("yLogScale") is True  # sigma spans decades


@pytest.mark.slow
def test_command_writes_a_sweep_report_spec_and_refuses_bad_input(tmp_path):
    out = _report("--project", "me/qerl-exp", "--sweep", "noise_schedule", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["report 'qerl-exp sweep: noise_schedule': 5 panels over W&B group "
                                       "'noise_schedule' in me/qerl-exp", f"wrote {tmp_path / 'r.json'}"]
    spec = json.loads((tmp_path / "r.json").read_text())
    assert _runset(spec)["filters"]["filters"][0]["value"] == "noise_schedule"
    panels = _panels(spec)
    assert [p["config"].get("groupBy") for p in panels[:4]] == ["choices.value.trial", "choices.value.noise",
                                                                "choices.value.noise", "choices.value.trial"]
    assert panels[-1]["viewType"] == "Parameter Importance" and panels[-1]["config"]["targetKey"] == "reward/final"

    bad = _report("--project", "qerl-exp", "--group", "arith")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --project 'qerl-exp': give ENTITY/PROJECT, e.g. me/qerl-exp"]


def test_save_without_credentials_fails_in_one_line_and_keeps_the_spec(tmp_path):
    env = {"WANDB_API_KEY": "", "WANDB_CONFIG_DIR": str(tmp_path / "cfg"), "NETRC": str(tmp_path / "netrc"),
           "HOME": str(tmp_path)}  # no login anywhere
    out = _report("--project", "me/qerl-exp", "--group", "arith", "--json", str(tmp_path / "r.json"), "--save", env=env)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the report was not saved (") and "wandb login" in lines[0], out.stderr
    assert json.loads((tmp_path / "r.json").read_text())["displayName"] == "qerl-exp strategies: arith"


@pytest.mark.skipif(not os.environ.get("WANDB_API_KEY"), reason="saving needs a W&B server and an API key")
def test_save_uploads_the_report():
    entity = os.environ.get("WANDB_ENTITY", "")
    out = _report("--project", f"{entity}/qerl-exp", "--group", "arith", "--save", env={"WANDB_MODE": "online"})
    assert out.returncode == 0 and "saved: http" in out.stdout, out.stderr[-2000:]
