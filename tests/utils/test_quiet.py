"""megarl.utils.quiet (via megarl.cli.configure_logging): megatron-core's known Apex / Transformer
Engine fallback warnings become one log line; every other warning is still shown."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Imports the megatron-core modules that warn (as a run does), then warns in ways that are not known.
SCRIPT = r"""
import logging, warnings
from megarl.cli import configure_logging
configure_logging()
import megatron.core.optimizer, megatron.core.models.backends, megatron.core.models.gpt.gpt_layer_specs
import megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision
from megatron.core.rerun_state_machine import get_rerun_state_machine
get_rerun_state_machine()
mcore = megatron.core.__file__.rsplit("/", 1)[0] + "/tensor_parallel/layers.py"
warnings.warn_explicit("When using async grad allreduce it is recommended to set the environment variable "
                       "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", UserWarning, mcore, 738)
warnings.warn("UNKNOWN-1: a warning nobody listed")
warnings.warn_explicit("Apex is not installed. Falling back to something new", UserWarning, mcore, 1)
logging.getLogger("megatron.core.rerun_state_machine").warning("UNKNOWN-3: RerunStateMachine initialized in mode RerunMode.VALIDATE_RESULTS")
"""
KNOWN = ("Apex is not installed. Falling back to Torch Norm", "Transformer Engine and Apex are not installed",
         "Implicit initialization of Rerun State Machine!", "RerunStateMachine initialized in mode RerunMode.DISABLED",
         "CUDA_DEVICE_MAX_CONNECTIONS")
SUMMARY = "megatron-core: using local fallbacks (no Apex, no Transformer Engine); its known warnings about them are hidden"


def _run(**env) -> str:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "", **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="file paths in the script assume POSIX")
def test_known_warnings_become_one_line_and_others_stay():
    err = _run(MEGARL_SHOW_KNOWN_WARNINGS="")
    assert err.count(SUMMARY) == 1, err
    for text in KNOWN:
        assert text not in err, (text, err)
    assert "UNKNOWN-1: a warning nobody listed" in err  # other warnings: unchanged
    assert "Apex is not installed. Falling back to something new" in err  # a megatron-core one not listed
    assert "UNKNOWN-3: RerunStateMachine initialized in mode RerunMode.VALIDATE_RESULTS" in err


def test_show_env_shows_everything():
    err = _run(MEGARL_SHOW_KNOWN_WARNINGS="1")
    assert SUMMARY not in err
    for text in KNOWN:
        assert text in err, (text, err)
