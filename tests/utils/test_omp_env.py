"""OpenMP's wait policy (megarl/utils/omp_env.py): set by the command line before torch loads, the
user's own setting kept."""
import os
import subprocess
import sys

PROBE = ("import os, sys; import megarl.cli; "
         "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")


def _probe(**env):
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         check=True)
    return out.stdout.split()


def test_cli_sets_passive_before_torch_is_loaded():
    # PASSIVE is in the environment and torch is not imported yet: libgomp will read it when it loads
    assert _probe() == ["PASSIVE", "False"]


def test_user_setting_is_kept():
    assert _probe(OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "False"]


def test_too_late_once_torch_is_imported(monkeypatch):
    import torch  # noqa: F401 - the suite has loaded it already
    from megarl.utils import omp_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert omp_env.apply() == {} and "OMP_WAIT_POLICY" not in os.environ
