"""`python -m qerl_exp.sweep dashboard`: optuna-dashboard on a study's storage, on a loopback port."""

from __future__ import annotations

import json
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, require_server

SPEC = """\
base: [train.steps=4]
params:
  noise.sigma_start: {type: float, low: 1.0e-3, high: 5.0e-2, log: true}
  noise.num_stages: {type: int, low: 2, high: 10}
objective: {metric: reward, direction: maximize}
n_trials: 3
"""


def _study(tmp_path: Path, storage: str = "", name: str = "tiny_sweep") -> tuple[Path, str, list[float]]:
    """A real study (SQLite unless `storage` is given), made the way the sweep makes it, with three
    told trials."""
    from qerl_exp.sweep.spec import load_plan, suggest
    from qerl_exp.sweep.study import open_storage, open_study

    spec = tmp_path / "tiny_sweep.yaml"
    spec.write_text(SPEC)
    storage = storage or f"sqlite:///{tmp_path / 'db' / 'study.db'}"
    plan = load_plan(spec, [f"storage={storage}", f"study_name={name}", f"sweep_dir={tmp_path / 'out'}"], check_config=False)
    study = open_study(plan, open_storage(plan), create=True)
    values = [0.25, 0.5, 0.125]
    for v in values:
        trial = study.ask()
        suggest(plan, trial)
        study.tell(trial, v)
    return spec, storage, values


def _dashboard(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qerl_exp.sweep", "dashboard", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_dashboard_serves_the_study_page_and_api_then_stops(tmp_path, backend, request):
    name = "tiny_sweep" if backend == "sqlite" else f"dash_{uuid.uuid4().hex[:8]}"
    storage = require_server(request.getfixturevalue("postgres")) if backend == "postgresql" else ""
    spec, storage, values = _study(tmp_path, storage, name)
    proc = _dashboard(str(spec), f"storage={storage}", f"study_name={name}", "port=0")
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the dashboard printed no address within 120 s"
        line = proc.stdout.readline()
        m = re.fullmatch(rf"optuna-dashboard: study '{name}' \(3 trials, {backend}://\S+\) at "
                         r"(http://127\.0\.0\.1:(\d+))/dashboard/studies/(\d+)  \(Ctrl-C stops it\)\n", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        base, study_id = m.group(1), int(m.group(3))

        status, kind, page = _get(f"{base}/dashboard/studies/{study_id}")
        assert status == 200 and kind.startswith("text/html") and "<title>Optuna Dashboard</title>" in page, page[:500]
        status, kind, body = _get(f"{base}/api/studies")
        studies = json.loads(body)["study_summaries"]
        assert (study_id, name) in [(s["study_id"], s["study_name"]) for s in studies]
        detail = json.loads(_get(f"{base}/api/studies/{study_id}")[2])
        assert [t["values"] for t in detail["trials"]] == [[v] for v in values]
        assert {p["name"] for p in detail["trials"][0]["params"]} == {"noise.sigma_start", "noise.num_stages"}
        assert detail["best_trials"][0]["values"] == [max(values)]
        assert detail["objective_names"] == ["reward"]  # objectives are labelled by metric
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    stopped = time.monotonic()
    with pytest.raises(OSError):  # nothing listens there any more
        urllib.request.urlopen(f"{base}/api/studies", timeout=5)
    assert time.monotonic() - stopped < 10


@pytest.mark.slow
def test_dashboard_refuses_a_missing_study_or_a_bad_port_in_one_line(tmp_path):
    spec, storage, _ = _study(tmp_path)
    cases = [
        ([f"storage=sqlite:///{tmp_path / 'none.db'}"], "no study 'tiny_sweep' yet: sqlite:///"),
        ([f"storage={storage}", "study_name=other"], "no study 'other' in sqlite:///"),
        ([f"storage={storage}", "port=http"], "port='http' must be a port number"),
    ]
    for args, message in cases:
        proc = _dashboard(str(spec), *args)
        out, err = proc.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not (tmp_path / "none.db").exists(), "looking for a study created an empty storage"
