"""Faults, tried on the real CLI: kill -9 at seeded moments, a kill inside a checkpoint
write, a killed torchrun worker, a full disk, torn JSONL lines, two runs on one directory. Each
ends, after ``--resume``, bitwise where the uninterrupted run of configs/smoke.yaml ended
(``smoke_run``, tests/conftest.py), whose steps all change the weights, so a resume that
restores too little cannot pass.

Cost: the faulted runs start from a copy of the reference's post-SFT checkpoint (step 0) or a
later one, so SFT runs once per session (in the reference), not per fault.
"""
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.checkpoint.rl_state import latest_checkpoint
from tests.cli_runs import (ROOT, SMOKE, assert_same_as, assert_weights_change_every_step, cli_env, copy_run_until,
                            read_metrics)

LAUNCH = str(ROOT / "tests" / "fault_launch.py")
# More seeds for a longer soak: MEGARL_FAULT_SEEDS=0,1,2,3 pytest tests/test_faults.py
SEEDS = [int(s) for s in os.environ.get("MEGARL_FAULT_SEEDS", "0").split(",")]


def train(run_dir: Path, fault: str | None = None, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``megarl train --config configs/smoke.yaml --run-dir RUN_DIR --resume`` (tests/fault_launch.py:
    SIGKILLed at ``fault``, a MEGARL_FAULT moment)."""
    env = cli_env(**({"MEGARL_FAULT": fault} if fault else {}))
    return subprocess.run([sys.executable, LAUNCH, "train", "--config", SMOKE, "--run-dir", str(run_dir), "--resume",
                           *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def assert_killed(proc: subprocess.CompletedProcess, fault: str) -> None:
    assert proc.returncode == -signal.SIGKILL, f"{fault}: exit {proc.returncode}, not killed:\n{proc.stderr[-3000:]}"


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


def steps_logged(run_dir: Path) -> list[int]:
    return [m["step"] for m in read_metrics(run_dir)] if (run_dir / "metrics.jsonl").exists() else []


def kill_plan(seed: int) -> tuple[str, str, str]:
    """Three moments of one run, drawn from ``seed``: a sample finishing in the rollout of step 1 or
    2 (not the step's last one), checkpoint 2's write, the lines of step 3 or 4 written (after
    checkpoint 2, before checkpoint 4: between checkpoints)."""
    rng = random.Random(seed)
    return f"rollout:{rng.choice([1, 2])}:{rng.randint(1, 31)}", "checkpoint:2", f"after_line:{rng.choice([3, 4])}"


@pytest.mark.parametrize("seed", SEEDS)
def test_kill9_at_seeded_moments_then_resume_is_bitwise(smoke_run, tmp_path, seed):
    """One run killed with SIGKILL four times (during a rollout, inside a checkpoint write, between
    checkpoints, inside the export), resumed after each: it ends bitwise as the uninterrupted run."""
    assert_weights_change_every_step(read_metrics(smoke_run))
    run = copy_run_until(smoke_run, tmp_path / "run", 0)  # a run killed right after its SFT
    rollout, ckpt, between = kill_plan(seed)
    a, b = int(rollout.split(":")[1]), int(between.split(":")[1])

    assert_killed(train(run, rollout), rollout)
    assert steps_logged(run) == list(range(1, a)) and latest_checkpoint(run).name == "step_000000"

    # Killed inside checkpoint 2's write: its temporary holds the trainer file, no state.json. The
    # "latest" checkpoint is still the previous good one, intact.
    assert_killed(train(run, ckpt), ckpt)
    (tmp,) = (run / "checkpoints").glob(".step_000002.tmp*")
    assert (tmp / "trainer.pt").is_file() and not (tmp / "state.json").exists()
    assert latest_checkpoint(run).name == "step_000000" and steps_logged(run) == [1, 2]

    # The next start removes the orphan (and resumes from step 0 again).
    assert_killed(train(run, between), between)
    assert not tmp.exists(), "the interrupted checkpoint write's temporary was not removed at the next start"
    assert latest_checkpoint(run).name == "step_000002" and steps_logged(run) == list(range(1, b + 1))

    assert_killed(train(run, "export"), "export")
    assert latest_checkpoint(run).name == "step_000004" and not (run / "hf").exists()
    assert (run / ".hf.pieces").is_dir()

    assert_ok(train(run))
    assert_same_as(run, smoke_run)


def test_torn_last_lines_are_dropped_on_resume(smoke_run, tmp_path):
    """A crash (or a full disk) during step 4's appends leaves half a line at the end of
    metrics.jsonl and timeline.jsonl; the resume from checkpoint 2 drops both with a warning naming
    each file and ends as the uninterrupted run."""
    run = copy_run_until(smoke_run, tmp_path / "run", 2)
    for name in ("metrics.jsonl", "timeline.jsonl"):
        lines = (smoke_run / name).read_text().splitlines(keepends=True)
        assert len(lines) == 4
        (run / name).write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    proc = train(run)
    assert_ok(proc)
    for name in ("metrics.jsonl", "timeline.jsonl"):
        assert any(f"{run / name}: dropping the torn last line" in ln for ln in proc.stderr.splitlines()), \
            proc.stderr[-3000:]
    assert_same_as(run, smoke_run)


def test_two_runs_on_one_directory(smoke_run, tmp_path):
    """Two runs started together on one directory: one exits 2 at once naming the other's pid; the
    other runs as if alone (bitwise the uninterrupted run)."""
    run = copy_run_until(smoke_run, tmp_path / "run", 0)
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", SMOKE, "--run-dir", str(run), "--resume"]
    t0 = time.monotonic()
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        ended, took = None, None
        while ended is None and time.monotonic() - t0 < 60:
            ended = next((p for p in procs if p.poll() is not None), None)
            time.sleep(0.02)
        took = time.monotonic() - t0
        assert ended is not None, "neither run was refused within 60 s"
        other = procs[1 - procs.index(ended)]
        _, err = ended.communicate()
        _, other_err = other.communicate(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert ended.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("megarl: error:") and f"pid {other.pid}" in last, last
    # ~0.3 s on an idle machine (the lock is the CLI's first act); bounded loosely: 2 busy cores
    assert took < 10, f"the refused run took {took:.1f} s to exit"
    assert other.returncode == 0, other_err[-3000:]
    assert_same_as(run, smoke_run)


def test_full_disk_fails_cleanly_and_resumes_on_a_bigger_disk(smoke_run, tmp_path):
    """The run directory on a tmpfs with room for checkpoint 2 but not checkpoint 4: exit 2 with one
    line naming the file and the last good checkpoint; the directory copied to a bigger disk
    resumes to the uninterrupted run's end, bitwise."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    start = copy_run_until(smoke_run, tmp_path / "start", 2)
    used = sum(p.stat().st_size for p in start.rglob("*") if p.is_file())
    room = used + (smoke_run / "checkpoints" / "step_000004" / "trainer.pt").stat().st_size // 2
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(mnt)], capture_output=True,
                           text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root / CAP_SYS_ADMIN): {mount.stderr.strip()}")
    try:
        run = mnt / "run"
        shutil.copytree(start, run)
        proc = train(run)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
        assert lines[-1].startswith(f"megarl: error: no space left on device writing {run}"), lines[-1]
        assert lines[-1].endswith(f"the last good checkpoint is {run / 'checkpoints' / 'step_000002'}"), lines[-1]
        assert latest_checkpoint(run).name == "step_000002"
        bigger = shutil.copytree(run, tmp_path / "bigger")
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert_ok(train(bigger))
    assert_same_as(bigger, smoke_run)


def torchrun(run_dir: Path, marks: Path, fault: str | None = None, rank: int = 1) -> tuple[subprocess.Popen, float]:
    """Two colocated processes (data parallel) on ``run_dir``, resumed; (process, seconds it took)."""
    marks.mkdir(exist_ok=True)
    env = cli_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", MEGARL_FAULT_DIR=str(marks),
                  **({"MEGARL_FAULT": fault, "MEGARL_FAULT_RANK": str(rank)} if fault else {}))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "--monitor-interval", "0.1", LAUNCH, "train", "--config", SMOKE, "--run-dir", str(run_dir),
                           "--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    return proc, time.monotonic() - t0


@pytest.mark.multiproc
def test_torchrun_worker_killed_then_resumed(smoke_run, tmp_path):
    """torchrun, 2 processes: SIGKILL of rank 1 after step 3 ends every process within seconds; the
    resume reaches bitwise the final weights of the uninterrupted 2-process run."""
    ref = copy_run_until(smoke_run, tmp_path / "ref", 0)
    proc, _ = torchrun(ref, tmp_path / "ref_marks")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_weights_change_every_step(read_metrics(ref))

    run, marks = copy_run_until(smoke_run, tmp_path / "run", 0), tmp_path / "marks"
    proc, _ = torchrun(run, marks, "after_step:3")
    ended = time.time()
    assert proc.returncode != 0
    killed_at = float((marks / "killed.1").read_text())
    assert ended - killed_at < 10, f"the run took {ended - killed_at:.1f} s to end after rank 1 died"
    for rank in (0, 1):
        pid = int((marks / f"pid.{rank}").read_text())
        status = Path(f"/proc/{pid}/status")
        alive = status.exists() and "zombie" not in status.read_text()
        assert not alive, f"rank {rank} (pid {pid}) survived the run's end"
    assert latest_checkpoint(run).name == "step_000002"

    proc, _ = torchrun(run, marks)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_as(run, ref)
