"""One sandboxed program's subprocess (megarl/rl/sandbox.py): its command line (bootstrap, bubblewrap,
memory cgroup), spawning it, reading its output until it exits or times out, and what happened."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from megarl.rl import sandbox_bwrap, sandbox_cgroup
from megarl.rl.sandbox_boot import BOOTSTRAP, EXIT_FILE_SIZE, EXIT_MEMORY
from megarl.rl.sandbox_io import DRAIN_GRACE_S, Output, kill_group, pump_to_eof, pump_until_exit

STATUSES = ("ok", "error", "timeout", "memory", "file_size", "killed")

_ENV_PATH = "/usr/local/bin:/usr/bin:/bin"


class SandboxUnavailable(RuntimeError):
    """The sandbox itself could not start (not something the program did): ``run_python``
    raises it rather than report a failing program (a ``RewardPool`` counts it as an error)."""


@dataclass
class SandboxResult:
    """What happened to one program."""

    status: str
    """One of ``STATUSES``: ok, error, timeout, memory, file_size, killed."""
    returncode: int | None
    """Exit code, or minus the signal number; None when the parent killed it at the timeout."""
    stdout: str
    """First ``max_output_bytes`` of stdout, decoded as UTF-8 with errors replaced."""
    stderr: str
    """First ``max_output_bytes`` of stderr, decoded likewise."""
    seconds: float
    """Wall time from spawning the interpreter to its exit (or kill)."""
    truncated: bool = False
    """True when stdout or stderr had more than ``max_output_bytes``."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@contextlib.contextmanager
def memory_group(limits):
    """The program's memory cgroup (``limits.memory_mb`` for all its processes), or None where
    this machine cannot make one (then memory is capped per process only)."""
    where = sandbox_cgroup.available()
    if isinstance(where, str):
        yield None
        return
    try:
        group = sandbox_cgroup.Group(*where, limits.memory_mb << 20)
    except OSError as exc:
        raise SandboxUnavailable(f"cannot make the sandbox's memory cgroup under {where[0]}: {exc}") from exc
    try:
        yield group
    finally:
        group.remove()


def _command(limits, mode: str, workdir: str, program_fd: int, started_fd: int) -> list[str]:
    mb = 1 << 20
    python = [sys.executable, "-I", "-S", "-B", "-c", BOOTSTRAP, mode,
              str(limits.memory_mb * mb), str(limits.cpu_s), str(limits.file_size_mb * mb), str(started_fd)]
    if mode != "bwrap":
        return python
    bwrap = sandbox_bwrap.find_bwrap()
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is no longer installed; it was when the sandbox was probed")
    python[0] = sandbox_bwrap.python_executable()
    return sandbox_bwrap.bwrap_command(bwrap, workdir, program_fd, limits.workdir_mb * mb,
                                       limits.file_size_mb * mb) + python


def _environment(workdir: str) -> dict[str, str]:
    return {"PATH": _ENV_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def spawn_and_wait(workdir: str, stdin_f, program_fd: int, group, limits, mode: str) -> SandboxResult:
    """Run the program (``main.py`` in ``workdir``, also readable from ``program_fd``) under
    ``limits`` (a ``SandboxLimits``) in containment ``mode`` and memory cgroup ``group`` (or
    None), and say what happened; ``SandboxUnavailable`` when the sandbox itself did not start."""
    started_r, started_w = os.pipe()
    try:
        argv = _command(limits, mode, workdir, program_fd, started_w)
        argv = group.command(argv) if group is not None else argv
        start = time.monotonic()
        # bwrap copies main.py in from program_fd; without bwrap the program must not get that fd
        fds = (program_fd, started_w) if mode == "bwrap" else (started_w,)
        proc = subprocess.Popen(argv, cwd=workdir, env=_environment(workdir), stdin=stdin_f, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, close_fds=True, pass_fds=fds)
    except BaseException:
        os.close(started_r)
        raise
    finally:
        os.close(started_w)
    try:
        out = Output(limits.max_output_bytes)
        timed_out = pump_until_exit(proc, out, start + limits.timeout_s)
        seconds = time.monotonic() - start
        kill_group(proc.pid)   # timeout, or stragglers after a normal exit
        pump_to_eof(proc, out, time.monotonic() + DRAIN_GRACE_S)
        returncode = proc.wait()
    except BaseException:
        kill_group(proc.pid)
        proc.kill()
        proc.wait()
        raise
    finally:
        proc.stdout.close()
        proc.stderr.close()
        started = _read_started(started_r)
    if not started and not timed_out:
        # the bootstrap never ran (bwrap's set-up or the cgroup failed): an infrastructure error,
        # not a failing program, so it must not read as reward 0.
        what = "bubblewrap could not start the sandbox" if mode == "bwrap" else "the sandbox did not start"
        raise SandboxUnavailable(f"{what}: {out.text(1).strip() or f'exit status {returncode}'}")
    if mode == "bwrap" and not timed_out:
        returncode = sandbox_bwrap.exit_status(returncode)
    status = classify(returncode, timed_out)
    if status in ("killed", "error") and group is not None and group.oom_killed():
        status = "memory"   # the cgroup's OOM killer ended a process: the group passed memory_mb
    return SandboxResult(status=status, returncode=None if timed_out else returncode,
                         stdout=out.text(0), stderr=out.text(1),
                         seconds=seconds, truncated=out.truncated)


def _read_started(fd: int) -> bool:
    """Whether the bootstrap wrote its byte (the pipe is closed here)."""
    try:
        os.set_blocking(fd, False)
        return os.read(fd, 1) == b"1"
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def classify(returncode: int, timed_out: bool) -> str:
    """The ``SandboxResult.status`` of an exit code (minus the signal for a signal death)."""
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    if returncode == EXIT_MEMORY:
        return "memory"
    if returncode == EXIT_FILE_SIZE or returncode == -signal.SIGXFSZ:
        return "file_size"
    if returncode == -signal.SIGXCPU:
        return "timeout"
    if returncode < 0:
        return "killed"
    return "error"


__all__ = ["STATUSES", "SandboxResult", "SandboxUnavailable", "classify", "memory_group", "spawn_and_wait"]
