"""The Makefile's venv rule: changing any C++ extension source that setup.py builds rebuilds the
install (otherwise `make test` would keep running a stale compiled extension)."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(set(re.findall(r'"(csrc/[\w.]+\.cpp)"', (ROOT / "setup.py").read_text())))


def test_setup_builds_both_extensions():
    assert SOURCES == ["csrc/keyed_gumbel.cpp", "csrc/suffix_index.cpp"]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("source", SOURCES)
def test_a_changed_extension_source_rebuilds_the_venv(tmp_path, source):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").touch()  # newer than every prerequisite: up to date unless one is "changed"
    cmd = ["make", "-n", "-C", str(ROOT), f"VENV={venv}", f"{venv}/.installed"]
    assert "is up to date" in subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    out = subprocess.run([*cmd, "-W", source], capture_output=True, text=True, check=True).stdout
    assert f"-m venv {venv}" in out and "pip install" in out
