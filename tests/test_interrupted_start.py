"""A run directory that holds only an interrupted start (no checkpoint yet) is started again, with
or without ``--resume``, and the run says so (megarl/run_dir.py). Each way a start can end before
its first checkpoint, tried on the real CLI: killed inside the post-SFT checkpoint's write, killed
before the first ``checkpoint_every`` steps of a run without SFT, and a full disk at the first
checkpoint. Each then ends bitwise as the uninterrupted run, with the command a user would run
(or the one the error message names)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_runs import ROOT, SMOKE, assert_same_as, assert_weights_change_every_step, cli_env, read_metrics
from tests.test_faults import LAUNCH, assert_killed, assert_ok

RESTARTED = "holds an interrupted start and no checkpoint"


def start(run_dir: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    """``megarl train --config configs/smoke.yaml --run-dir RUN_DIR EXTRA...`` (SIGKILLed at ``fault``)."""
    env = cli_env(**({"MEGARL_FAULT": fault} if fault else {}))
    return subprocess.run([sys.executable, LAUNCH, "train", "--config", SMOKE, "--run-dir", str(run_dir), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def assert_restarted(proc: subprocess.CompletedProcess) -> None:
    assert_ok(proc)
    assert RESTARTED in proc.stderr and "starts again from the beginning" in proc.stderr, proc.stderr[-3000:]


def test_killed_inside_the_post_sft_checkpoint_then_resume(smoke_run, tmp_path):
    """Killed while checkpoint 0 is written (its temporary holds the trainer file, no state.json):
    ``--resume`` starts the run again (there is nothing to resume from) and ends as the
    uninterrupted run; before, it was refused ("no checkpoint") and so was a start without it."""
    run = tmp_path / "run"
    assert_killed(start(run, fault="checkpoint:0"), "checkpoint:0")
    (tmp,) = (run / "checkpoints").glob(".step_000000.tmp*")
    assert (run / "sft.json").is_file() and not list((run / "checkpoints").glob("step_*"))
    assert_restarted(start(run, "--resume"))
    assert not tmp.exists()
    assert_same_as(run, smoke_run)


def test_killed_during_sft_then_resume(smoke_run, tmp_path):
    """Killed in the middle of SFT (the directory holds config.yaml only): ``--resume`` used to say
    "no checkpoint" without saying what to do; it now starts the run again, and says so."""
    run = tmp_path / "run"
    assert_killed(start(run, fault="sft:30"), "sft:30")
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.yaml"]
    assert_restarted(start(run, "--resume"))
    assert_same_as(run, smoke_run)


@pytest.fixture(scope="module")
def no_sft_run(smoke_run, tmp_path_factory):
    """The uninterrupted run of a config without SFT (``sft.steps=0``, as jsonl data needs),
    starting from the smoke run's export: its first checkpoint comes after ``checkpoint_every``
    steps."""
    run = tmp_path_factory.mktemp("no_sft") / "run"
    assert_ok(start(run, *no_sft_args(smoke_run)))
    assert not (run / "sft.json").exists() and (run / "checkpoints" / "step_000002").is_dir()
    assert not (run / "checkpoints" / "step_000000").exists()
    assert_weights_change_every_step(read_metrics(run))
    return run


def no_sft_args(smoke_run: Path) -> list[str]:
    return ["--set", "sft.steps=0", "--set", f"model.init_from_hf={smoke_run / 'hf'}"]


def test_run_without_sft_killed_before_its_first_checkpoint_then_started_again(smoke_run, no_sft_run, tmp_path):
    """Killed after step 1's lines, before checkpoint 2: the directory holds config.yaml,
    metrics.jsonl and timeline.jsonl of step 1 and no checkpoint. The same start command (no
    --resume) starts it again and ends as the uninterrupted run; before, it was refused ("already
    holds a run: pass --resume") and so was --resume ("no checkpoint")."""
    run = tmp_path / "run"
    assert_killed(start(run, *no_sft_args(smoke_run), fault="after_line:1"), "after_line:1")
    assert len(read_metrics(run)) == 1 and not (run / "checkpoints").exists()
    assert_restarted(start(run, *no_sft_args(smoke_run)))
    assert_same_as(run, no_sft_run)


def test_full_disk_at_the_first_checkpoint_then_the_command_the_message_names(smoke_run, tmp_path):
    """The run directory on a tmpfs with room for everything before checkpoint 0 but not for it:
    exit 2 with one line saying that no checkpoint was written and to run the same command again;
    the directory copied to a bigger disk and that command run there ends as the uninterrupted run."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    room = (smoke_run / "checkpoints" / "step_000000" / "trainer.pt").stat().st_size // 2
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(mnt)], capture_output=True,
                           text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root / CAP_SYS_ADMIN): {mount.stderr.strip()}")
    try:
        run = mnt / "run"
        proc = start(run)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
        assert lines[-1].startswith(f"megarl: error: no space left on device writing {run / 'checkpoints'}"), lines[-1]
        assert lines[-1].endswith("no checkpoint was written yet: make room and run the same command again (it "
                                  "starts the run again from the beginning)"), lines[-1]
        assert (run / "sft.json").is_file()
        bigger = shutil.copytree(run, tmp_path / "bigger", symlinks=True)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert_restarted(start(bigger))
    assert_same_as(bigger, smoke_run)
