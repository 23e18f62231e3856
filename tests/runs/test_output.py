"""What a researcher sees on the command line: a live progress line, no third-party notices, no
`schema` pseudo-preset."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from bitsandbytes.functional import has_avx512bf16

from conftest import ROOT, SUBPROCESS_ENV, TINY_RUN, qerl

# The notices `qerl_exp.run.logs.quiet` silences, as they read on these machines.
NOTICES = ("not sharded", "Loading weights", "Writing model shards", "gemm_4bit_forward", "pip install kernels",
           "FutureWarning", "torchao", "register_constant", "publisher trust check")


@pytest.mark.slow
def test_nf4_run_shows_progress_and_no_third_party_notices(tmp_path):
    run_dir = tmp_path / "run"
    # the hub offline: bitsandbytes' optional kernel is then looked up by `kernels` without its trust check
    out = qerl("quant=nf4", "train.steps=6", f"run_dir={run_dir}", env={"WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    for notice in NOTICES:
        assert notice not in text, f"{notice!r} printed:\n{text[-3000:]}"
    lines = [line for line in out.stderr.splitlines() if not line.startswith("warm-up")]  # a cache miss's bar
    # Not a terminal: plain lines, the first step and the last (whose numbers are the run's).
    assert re.match(r"train step 1/6 \| reward \d\.\d{3} \| entropy \d\.\d{3} \| sigma 0 \| tok/s \d+ \| ", lines[0]), lines
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert lines[-1].startswith(f"train step 6/6 | reward {last['reward']:.3f} | entropy {last['entropy']:.3f} |"), lines
    assert out.stdout.strip().splitlines() == [f"run dir: {run_dir}  final reward: {json.loads((run_dir / 'summary.json').read_text())['reward/final']:.3f} (mean of the last quarter of steps)"]

    # W&B's terminal viewer (`wandb leet RUN_DIR/wandb`, README) reads the offline run it wrote.
    wandb_file = next(run_dir.glob("wandb/latest-run/run-*.wandb"))
    leet = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", str(wandb_file)],
                          capture_output=True, text=True, timeout=120)
    assert leet.returncode == 0, leet.stderr[-2000:]
    for name in ("reward", "entropy_gain", "quant/kl"):
        assert f'"{name}"' in leet.stdout, name


@pytest.mark.slow
def test_verbose_shows_the_notices(tmp_path):
    out = qerl(*TINY_RUN, "quant=nf4", "train.steps=1", "monitor.every=0", f"run_dir={tmp_path / 'run'}", "verbose=true")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Loading weights" in out.stderr and "register_constant" in out.stderr, out.stderr[-3000:]
    # bitsandbytes looks for its hub kernel (and says it failed) only on AVX512-BF16 CPUs: Intel, not AMD EPYC
    assert ("gemm_4bit_forward" in out.stderr) == has_avx512bf16(), out.stderr[-3000:]


@pytest.mark.slow
def test_a_reader_that_exits_early_does_not_fail_the_run(tmp_path):
    """`python -m qerl_exp ... 2>&1 | head -1`: the run finishes whoever stops reading its output."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "qerl_exp", *TINY_RUN, "train.steps=4", f"run_dir={run_dir}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=SUBPROCESS_ENV)
    first = proc.stdout.readline()  # the first step's line; more come after it
    proc.stdout.close()
    assert proc.wait(timeout=600) == 0, first
    assert (run_dir / "summary.json").exists() and not (run_dir / "error.txt").exists()


def test_output_to_a_reader_that_is_gone_goes_to_devnull(monkeypatch):
    from qerl_exp.run.console import tolerate_closed_pipes

    read, write = os.pipe()
    os.close(read)  # the reader (head -1) has exited
    monkeypatch.setattr(sys, "stdout", os.fdopen(write, "w", buffering=1))
    monkeypatch.setattr(sys, "stderr", sys.stderr)  # restored after the test, as stdout is
    tolerate_closed_pipes()
    print("train step 1/3")  # EPIPE: written nowhere, raised nowhere
    print("run dir: ...")
    sys.stdout.flush()
    assert os.readlink(f"/proc/self/fd/{write}") == os.devnull
    sys.stdout.close()


@pytest.mark.slow
def test_help_and_values_offer_no_schema_preset():
    help_text = qerl("--help").stdout
    assert re.search(r"^quant: bf16, mxfp4, nf4, nf4_dq, nvfp4$", help_text, re.M), help_text
    assert "schema" not in help_text
    out = qerl("quant=schema", "train.steps=1")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: quant=schema is not a preset; choose one of: bf16, mxfp4, nf4, nf4_dq, nvfp4"]
    # The root schema still types every group's fields.
    out = qerl("lora.r=x")
    assert out.returncode == 2 and out.stderr.strip() == "error: bad value for 'lora.r': Value 'x' of type 'str' could not be converted to Integer"
