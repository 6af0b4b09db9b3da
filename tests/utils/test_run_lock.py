"""The run-directory lock: one run per directory, no stale lock after a crash."""
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.utils.run_lock import LOCK_NAME, RunDirLocked, RunLock, lock_run_dir

REPO = Path(__file__).resolve().parents[2]

# A second process trying the lock: prints how long the attempt took and the error, exits 2 (as
# the CLI does for a ValueError).
TRY = """
import sys, time
from megarl.utils.run_lock import RunDirLocked, RunLock
t0 = time.monotonic()
try:
    RunLock(sys.argv[1]).acquire()
except RunDirLocked as e:
    print(f"{time.monotonic() - t0:.3f}", e, flush=True)
    sys.exit(2)
print("acquired", flush=True)
"""

# Holds the lock until killed.
HOLD = """
import sys, time
from megarl.utils.run_lock import RunLock
lock = RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(60)
"""


def _python(code: str, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = _python(HOLD, str(run_dir))
    assert proc.stdout.readline() == "held\n", proc.stderr.read()
    return proc


def test_second_process_fails_within_a_second_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        t0 = time.monotonic()
        proc = _python(TRY, str(run_dir))
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 2, err
        attempt_s, message = out.split(" ", 1)
        assert float(attempt_s) < 1.0 and time.monotonic() - t0 < 10.0
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
        assert str(run_dir) in message and "--run-dir" in message


def test_a_run_taking_the_lock_this_moment_is_named_not_the_dead_previous_holder(tmp_path):
    """Two runs started together: the winner holds the flock a moment before it writes its pid over
    the dead previous holder's; the refused run waits for that instead of naming the dead pid."""
    import fcntl
    import threading

    from megarl.utils import run_lock

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "x"}))
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the winner, before it wrote itself in
        writer = threading.Timer(0.2, run_lock._write_holder, args=(fd,))
        writer.start()
        with pytest.raises(RunDirLocked) as err:
            RunLock(run_dir).acquire()
        writer.join()
    finally:
        os.close(fd)
    assert err.value.holder["pid"] == os.getpid() and f"pid {os.getpid()} on host" in str(err.value)


def test_lock_of_a_sigkilled_holder_is_taken_over(tmp_path, caplog):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid} on host {socket.gethostname()}") as info:
            RunLock(run_dir).acquire()
        assert info.value.holder["pid"] == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == holder.pid   # the stale file is left
    with caplog.at_level(logging.INFO, logger="megarl.utils.run_lock"):
        with RunLock(run_dir) as lock:
            assert lock.held
            assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"left by pid {holder.pid}" in caplog.text and "no longer running" in caplog.text


def test_release_lets_the_next_run_in_and_empties_the_file(tmp_path):
    run_dir = tmp_path / "a" / "b"   # created, parents included
    with RunLock(run_dir) as lock:
        info = json.loads((run_dir / LOCK_NAME).read_text())
        assert info["pid"] == os.getpid() and info["host"] == socket.gethostname() and info["started"]
        with pytest.raises(RunDirLocked):   # a second descriptor conflicts even in the same process
            RunLock(run_dir).acquire()
    assert not lock.held
    assert (run_dir / LOCK_NAME).read_text() == ""
    proc = _python(TRY, str(run_dir))
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out) == (0, "acquired\n"), err


def test_lock_is_not_inherited_by_executed_children(tmp_path):
    """A subprocess the run starts (e.g. a sandboxed program) must not keep the lock alive after
    the run dies: the descriptor is close-on-exec."""
    run_dir = tmp_path / "run"
    holder = _python(HOLD.replace('print("held", flush=True)',
                                  'import subprocess; subprocess.Popen(["sleep", "30"], close_fds=False)\n'
                                  'print("held", flush=True)'), str(run_dir), start_new_session=True)
    try:
        assert holder.stdout.readline() == "held\n"
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        with RunLock(run_dir):   # the sleeping grandchild does not hold it
            pass
    finally:
        os.killpg(holder.pid, signal.SIGKILL)


def test_run_dir_that_is_a_file_is_a_clear_error(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        RunLock(path).acquire()


def test_only_rank_zero_locks(tmp_path, monkeypatch):
    assert lock_run_dir(tmp_path / "r1", rank=1) is None
    assert not (tmp_path / "r1").exists()
    monkeypatch.setenv("RANK", "3")
    assert lock_run_dir(tmp_path / "r3") is None
    monkeypatch.setenv("RANK", "0")
    lock = lock_run_dir(tmp_path / "r0")
    try:
        assert lock.held and issubclass(RunDirLocked, ValueError)
        with pytest.raises(RunDirLocked):
            lock_run_dir(tmp_path / "r0", rank=0)
    finally:
        lock.release()
