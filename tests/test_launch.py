"""``python -m megarl.launch``: torchrun with megarl's error contract (one line, exit 2 for bad
input; no ChildFailedError traceback), and configs/tp2.yaml, a 2-process config that learns."""
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megarl.launch import exit_line, split_args
from tests.cli_runs import ROOT, assert_weights_change_every_step, cli_env, read_metrics


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl.launch", "--standalone", "--nproc_per_node", "2", *args],
                          cwd=ROOT, env=cli_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""), capture_output=True,
                          text=True, timeout=600)


def test_exit_line_names_the_first_failure():
    def f(code, t):
        return SimpleNamespace(exitcode=code, timestamp=t)

    assert exit_line({0: f(2, 5), 1: f(-signal.SIGTERM, 6)}) == (None, 2)  # rank 0 printed the error
    assert exit_line({1: f(-signal.SIGKILL, 5), 0: f(-signal.SIGTERM, 6)}) == (
        "megarl: error: rank 1 was killed by SIGKILL (then rank(s) 0): its output above says why", 137)
    assert exit_line({0: f(70, 5)}) == ("megarl: error: rank 0 exited with status 70: its output above says why", 70)
    assert split_args(["--nproc_per_node", "2", "train", "--run-dir", "r"]) == (["--nproc_per_node", "2"],
                                                                                ["train", "--run-dir", "r"])
    with pytest.raises(ValueError, match="no megarl command"):
        split_args(["--nproc_per_node", "2"])


@pytest.mark.multiproc
def test_bad_input_under_the_launcher_is_one_line(tmp_path):
    """Both processes refuse the input: one ``megarl: error:`` line (rank 0's), exit 2, no
    traceback, and the existing run folder as it was (no lock file left); under plain torchrun
    the same input gave the line twice, ChildFailedError's traceback, exit 1 and a .lock."""
    run = tmp_path / "run"
    run.mkdir()
    proc = launch("train", "--config", "configs/tp2.yaml", "--run-dir", str(run), "--set", "rollout.temperature=-1")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines == ["megarl: error: rollout.temperature=-1.0 is invalid; valid range: >= 0 (0 = greedy)"], lines
    assert list(run.iterdir()) == []


@pytest.mark.multiproc
def test_tp2_config_learns(tmp_path):
    """configs/tp2.yaml (trainer TP=2 on 2 processes) has mixed rewards and changes the weights in
    every step, so a test built on it can fail (it used to have reward 0 and constant weights)."""
    run = tmp_path / "run"
    proc = launch("train", "--config", "configs/tp2.yaml", "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(0 < m["reward_mean"] < 1 for m in metrics), [m["reward_mean"] for m in metrics]
    assert_weights_change_every_step(metrics)
