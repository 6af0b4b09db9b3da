"""Reading a sandboxed child's stdout and stderr while it runs (megarl/rl/sandbox.py): both pipes
drained as data arrives, kept up to a cap (a program printing in a loop must not fill memory or
block on a full pipe), the child's exit noticed without a busy loop, its process group killed."""
from __future__ import annotations

import contextlib
import fcntl
import os
import selectors
import signal
import subprocess
import time

DRAIN_GRACE_S = 1.0   # after the child is gone, how long to wait for the pipes to reach EOF
_POLL_S = 0.05          # exit polling period when pidfd_open is unavailable
_READ_CHUNK = 1 << 20
PIPE_SIZE = 1 << 20    # a bigger pipe means fewer wake-ups while draining a print flood


class Output:
    """The first ``cap`` bytes of stdout (stream 0) and stderr (stream 1)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.bufs = (bytearray(), bytearray())
        self.truncated = False

    def add(self, stream: int, chunk: bytes) -> None:
        buf = self.bufs[stream]
        room = self.cap - len(buf)
        if room > 0:
            buf += chunk[:room]
        if len(chunk) > max(room, 0):
            self.truncated = True

    def text(self, stream: int) -> str:
        return self.bufs[stream].decode("utf-8", errors="replace")


def _pipes(proc: subprocess.Popen) -> dict[int, int]:
    """fd -> stream index, for the pipes still open."""
    pipes = {}
    for i, f in enumerate((proc.stdout, proc.stderr)):
        if not f.closed:
            os.set_blocking(f.fileno(), False)
            with contextlib.suppress(AttributeError, OSError):
                fcntl.fcntl(f.fileno(), fcntl.F_SETPIPE_SZ, PIPE_SIZE)
            pipes[f.fileno()] = i
    return pipes


def pump_until_exit(proc: subprocess.Popen, out: Output, deadline: float) -> bool:
    """Read output until the child exits (not reaped: its process group stays valid for
    ``_kill_group``) or ``deadline`` passes. Returns True on timeout."""
    pipes = _pipes(proc)
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    with selectors.DefaultSelector() as sel:
        for fd in pipes:
            sel.register(fd, selectors.EVENT_READ)
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ)
        try:
            while True:
                if _exited(proc.pid):
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return True
                wait = remaining if pidfd is not None else min(remaining, _POLL_S)
                for key, _ in sel.select(wait):
                    if key.fd != pidfd and not _read_once(key.fd, pipes, out):
                        sel.unregister(key.fd)
        finally:
            if pidfd is not None:
                os.close(pidfd)


def pump_to_eof(proc: subprocess.Popen, out: Output, deadline: float) -> None:
    """After the group is killed: read what is left in the pipes, until EOF or ``deadline`` (a
    process that escaped the group could hold a pipe open)."""
    pipes = _pipes(proc)
    with selectors.DefaultSelector() as sel:
        for fd in pipes:
            sel.register(fd, selectors.EVENT_READ)
        while pipes and (remaining := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(remaining):
                if not _read_once(key.fd, pipes, out):
                    sel.unregister(key.fd)
                    del pipes[key.fd]


def _read_once(fd: int, pipes: dict[int, int], out: Output) -> bool:
    """One non-blocking read into ``out``; False at EOF."""
    try:
        chunk = os.read(fd, _READ_CHUNK)
    except BlockingIOError:
        return True
    if not chunk:
        return False
    out.add(pipes[fd], chunk)
    return True


def _exited(pid: int) -> bool:
    """Has ``pid`` exited? Does not reap it (WNOWAIT)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
