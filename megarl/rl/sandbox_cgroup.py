"""A memory cgroup per sandboxed program (megarl/rl/sandbox.py): one cap on the resident memory of
all its processes together, tmpfs files they write included.

Why a cgroup: RLIMIT_AS caps each process alone, so three children of 700 MB each pass a 1 GB
limit; RLIMIT_NPROC (to bound how many there are) counts every task of the user machine-wide and
does not apply to root at all. A memory cgroup charges every page the group touches, whatever
process or file (tmpfs) it belongs to, and the kernel's OOM killer ends the group's processes
when the sum passes the cap.

Where: a child of this process's own memory cgroup (cgroup v1 ``memory`` hierarchy, or cgroup v2
when that cgroup already delegates the ``memory`` controller to its children). That needs write
access there: root, or a delegated subtree. Where neither works, ``available()`` says why and
programs keep the per-process cap only.

How a program enters it without a race: the command starts as ``sh -c 'echo $$ > cgroup.procs;
exec ...'``, so the interpreter and everything it forks are charged from their first page.
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import threading
import time

_ROOT = "/sys/fs/cgroup"
_ENTER = 'echo $$ > "$0" && exec "$@"'
log = logging.getLogger(__name__)
_lock = threading.Lock()
_probed: dict[str, object] = {}


class Group:
    """One program's memory cgroup: ``command()`` wraps its command line, ``oom_killed()`` tells
    whether the cap ended a process, ``remove()`` kills what is left and deletes it."""

    def __init__(self, parent: str, version: int, limit_bytes: int):
        self.path = os.path.join(parent, f"megarl-sandbox-{secrets.token_hex(6)}")
        self.version = version
        os.mkdir(self.path)
        try:
            if version == 1:
                _write(self.path, "memory.limit_in_bytes", limit_bytes)
                with contextlib.suppress(OSError):   # no swap accounting: swap is not used anyway
                    _write(self.path, "memory.memsw.limit_in_bytes", limit_bytes)
            else:
                _write(self.path, "memory.max", limit_bytes)
                with contextlib.suppress(OSError):
                    _write(self.path, "memory.swap.max", 0)
        except BaseException:
            os.rmdir(self.path)
            raise

    def command(self, argv: list[str]) -> list[str]:
        return ["/bin/sh", "-c", _ENTER, os.path.join(self.path, "cgroup.procs"), *argv]

    def oom_killed(self) -> bool:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(self.path, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value) > 0:
                        return True
        # v1 kernels without an oom_kill counter: a failed charge at the cap
        if self.version == 1:
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(self.path, "memory.failcnt")) as f:
                    return int(f.read()) > 0
        return False

    def remove(self, within_s: float = 2.0) -> None:
        """SIGKILL every process still in the group (without a PID namespace, a ``setsid()``
        grandchild is still here), then delete it; the kernel needs a moment to empty it."""
        deadline = time.monotonic() + within_s
        while True:
            for pid in _pids(self.path):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if time.monotonic() > deadline:   # never fail the call for it: say so, leave it
                    log.warning("megarl sandbox: cannot remove the memory cgroup %s: %s", self.path, exc)
                    return
                time.sleep(0.02)


def _write(path: str, name: str, value: int) -> None:
    with open(os.path.join(path, name), "w") as f:
        f.write(str(value))


def _pids(path: str) -> list[int]:
    with contextlib.suppress(OSError):
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]
    return []


def _own_cgroups() -> tuple[str | None, str | None]:
    """(v1 memory cgroup dir, v2 cgroup dir) of this process, where mounted."""
    v1 = v2 = None
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, rel = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                v1 = os.path.join(_ROOT, "memory", rel.lstrip("/"))
            elif controllers == "":
                for mount in (_ROOT, os.path.join(_ROOT, "unified")):
                    if os.path.exists(os.path.join(mount, "cgroup.controllers")):
                        v2 = os.path.join(mount, rel.lstrip("/"))
                        break
    return v1, v2


def _probe() -> tuple[str, int] | str:
    """(parent dir, version) where a capped child cgroup can be made, else why not."""
    try:
        v1, v2 = _own_cgroups()
    except (OSError, ValueError) as exc:
        return f"cannot read /proc/self/cgroup ({exc})"
    candidates = []
    if v2 is not None:
        with contextlib.suppress(OSError):
            with open(os.path.join(v2, "cgroup.subtree_control")) as f:
                if "memory" in f.read().split():
                    candidates.append((v2, 2))
    if v1 is not None and os.path.isdir(v1):
        candidates.append((v1, 1))
    problems = []
    for parent, version in candidates:
        try:
            Group(parent, version, 64 << 20).remove()
            return parent, version
        except OSError as exc:
            problems.append(f"{parent}: {exc.strerror or exc}")
    if not candidates:
        return "no memory cgroup controller is available to this process"
    return "cannot make a memory cgroup (" + "; ".join(problems) + ")"


def available() -> tuple[str, int] | str:
    """Probed once per process: (parent dir, cgroup version) or, where none can be made, why."""
    with _lock:
        if "result" not in _probed:
            _probed["result"] = _probe()
            if isinstance(_probed["result"], str):
                log.warning("megarl sandbox: %s: memory is capped per process (RLIMIT_AS), not for a "
                            "program's processes together", _probed["result"])
        return _probed["result"]


__all__ = ["Group", "available"]
