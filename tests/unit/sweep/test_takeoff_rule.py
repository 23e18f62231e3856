"""The Qwen2.5-Coder study's take-off rule (`sweeps/qwen_coder_takeoff.py`), fixed before its runs:
full precision takes off when, at one rate, every seed gains a quarter of its headroom."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = ROOT / "sweeps" / "qwen_coder_takeoff.py"


def _trial(sweep, name, strategy, lr, seed, start, end, steps=60):
    folder = sweep / "trials" / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"seed": seed, "train": {"lr": lr}, "choices": {"strategy": strategy}}))
    rows = [{"step": s, "reward": start if s < 30 else end} for s in range(steps)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _verdict(sweep):
    return subprocess.run([sys.executable, str(SCRIPT), str(sweep)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("second_seed_end, took_off", [(1.0, True), (0.9, False)])
def test_every_seed_of_one_rate_must_gain_a_quarter_of_its_headroom(tmp_path, second_seed_end, took_off):
    # start 0.4: headroom 1.6, a quarter of it 0.4
    _trial(tmp_path, "t0", "full_precision", 2e-4, 100, 0.4, 0.85)
    _trial(tmp_path, "t1", "full_precision", 2e-4, 101, 0.6, second_seed_end)  # needs 0.35: 0.4 passes, 0.3 not
    _trial(tmp_path, "t2", "full_precision", 5e-4, 100, 0.4, 2.0)  # one seed alone does not make a rate
    _trial(tmp_path, "t3", "nvfp4_lora_noaqn", 2e-4, 100, 0.0, 2.0)  # other rows do not count
    _trial(tmp_path, "t4", "full_precision", 5e-4, 101, 0.0, 2.0, steps=40)  # unfinished: left out
    out = _verdict(tmp_path)
    assert out.returncode == (0 if took_off else 1), out.stdout
    assert "full_precision lr 0.0002 seed 100: gain +0.450, needs 0.400" in out.stdout
    assert out.stdout.count("full_precision lr") == 3 and "nvfp4" not in out.stdout
