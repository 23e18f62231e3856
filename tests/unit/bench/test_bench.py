"""The benchmarks start in the environment the README's install builds: every module of `bench/`
answers `--help` when run as `python -m bench.X`, none is named like an installed package (a
`bench/kernels.py` once shadowed the `kernels` package transformers imports), and a benchmark's
record names its commit, device and command."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from conftest import ROOT, SUBPROCESS_ENV

RUNNABLE = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "bench").rglob("*.py")
    if 'if __name__ == "__main__":' in p.read_text())


def test_every_bench_module_answers_help_when_run_as_a_module():
    assert {"bench.quant", "bench.step", "bench.rollout", "bench.engine_kernels", "bench.dispatch_sweep",
            "bench.profile.learner"} <= set(RUNNABLE)
    # as after the README's install, where a CPU torch brings no Triton
    script = ("import runpy, sys\n"
              "sys.modules['triton'] = None\n"
              "for name in sys.argv[1:]:\n"
              "    sys.argv = [name, '--help']\n"
              "    try:\n"
              "        runpy.run_module(name, run_name='__main__', alter_sys=True)\n"
              "    except SystemExit as e:\n"
              "        assert e.code in (0, None), (name, e.code)\n"
              "    print('OK', name, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script, *RUNNABLE], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=SUBPROCESS_ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line.split()[1] for line in out.stdout.splitlines() if line.startswith("OK ")] == RUNNABLE
    # and as a user types it, in a fresh process
    quant = subprocess.run([sys.executable, "-m", "bench.quant", "--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env=SUBPROCESS_ENV)
    assert quant.returncode == 0 and "--repeats" in quant.stdout, quant.stderr[-2000:]


def test_no_bench_module_is_named_like_an_installed_package():
    names = {p.stem for p in (ROOT / "bench").rglob("*.py")} - {"__init__"}
    shadowed = sorted(n for n in names if importlib.util.find_spec(n) is not None)
    assert shadowed == [], f"bench modules named like installed packages: {shadowed}"


def test_a_record_names_what_made_it(tmp_path, monkeypatch):
    from bench import record

    monkeypatch.setattr(sys, "argv", ["bench.quant", "--repeats", "1"])
    path = record.write("quant", [{"format": "nvfp4", "ratio": 0.28}], {"threads": 1}, out=tmp_path)
    data = json.loads(path.read_text())
    assert path.parent == tmp_path / "quant" and path.name.endswith(f"-{data['commit']}.json")
    assert data["command"] == "python -m bench.quant --repeats 1" and data["threads"] == 1
    assert data["rows"] == [{"format": "nvfp4", "ratio": 0.28}] and data["device"] == record.device()
    assert data["commit"] == record.commit() != "unknown"


def test_records_of_other_workloads_sit_side_by_side(tmp_path):
    from bench import record

    strategies = ("7b", "full_precision,nvfp4_lora", "packed")
    paper = record.write("step", [{"step_s": 9.3}], out=tmp_path, workload=("paper", *strategies))
    wide = record.write("step", [{"step_s": 5.3}], out=tmp_path, workload=("wide", *strategies))
    assert paper.name == f"{paper.name.split('-paper-')[0]}-paper-7b-full_precision+nvfp4_lora-packed.json"
    assert wide != paper and json.loads(paper.read_text())["rows"] == [{"step_s": 9.3}]
    # a rerun of one workload replaces its own record
    assert record.write("step", [{"step_s": 9.1}], out=tmp_path, workload=("paper", *strategies)) == paper
    assert json.loads(paper.read_text())["rows"] == [{"step_s": 9.1}] and len(list(tmp_path.glob("step/*"))) == 2


def test_a_copy_of_the_tree_without_git_is_named_by_qerl_commit_or_else_the_version(tmp_path, monkeypatch):
    import qerl_exp
    from bench import record

    monkeypatch.setenv("GIT_DIR", str(tmp_path / "no-repository"))  # git finds no checkout
    monkeypatch.delenv("QERL_COMMIT", raising=False)
    path = record.write("rollout", [], out=tmp_path, workload=("7b", "b8,64"))
    assert json.loads(path.read_text())["commit"] == f"v{qerl_exp.__version__}"
    assert path.name.endswith(f"-v{qerl_exp.__version__}-7b-b8+64.json")
    monkeypatch.setenv("QERL_COMMIT", "bb83d87b" + "0" * 32 + "-dirty")  # a full hash is shortened as git's
    assert record.commit() == "bb83d87-dirty"
    monkeypatch.setenv("QERL_COMMIT", "bb83d87")
    assert record.write("rollout", [], out=tmp_path, workload=("7b",)).name.endswith("-bb83d87-7b.json")
