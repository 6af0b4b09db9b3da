"""One run per run directory: an advisory ``flock`` on ``RUN_DIR/.lock``, held for the whole run.

Why: two ``megarl train`` on one ``--run-dir`` both used to run to the end, interleaving
``metrics.jsonl`` and overwriting each other's config, checkpoints and export. The
"directory already holds a run" check cannot see a run still in its SFT window, whereas a lock
held from before the first write to the last one can.

Why ``flock``: the kernel releases it when the holder's last file descriptor closes, so a run
that crashes, is SIGKILLed or loses its node (on a local file system) never leaves a lock that
blocks the next run. The lock *file* stays behind after a crash with the dead holder's pid, host
and start time in it; the next run simply takes it over (the flock, not the file, is the lock)
and logs whose it was. A run's release leaves the file; a refused start removes it
(``release(remove=True)``, while still holding the flock) so that it leaves nothing behind. Deleting
a lock file races with a process that opened it just before: it would lock the deleted file while a
third opens a new one (two holders of two files). So ``acquire`` checks, once it holds the flock,
that the file it locked is still the one at the path, and opens it again if not.

Multi-process runs: only rank 0 takes the lock, and it must do so before any process writes to
the run directory. ``RunLock`` needs no process group, so rank 0 can take it first thing (before
``init_process_group``): the other ranks wait in the rendezvous until rank 0 joins, and if rank 0
exits on ``RunDirLocked`` the launcher (torchrun, Slurm) ends them.

Limits: advisory (a process that does not take the lock is not stopped); on NFS, Linux maps
``flock`` onto NFS byte-range locks, which hold across clients with NFSv4 but not with a
``nolock`` mount.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".lock"
log = logging.getLogger(__name__)


class RunDirLocked(ValueError):
    """Another live process holds the run directory's lock (a user error: the CLI prints the
    message and exits 2)."""

    def __init__(self, message: str, holder: dict):
        super().__init__(message)
        self.holder = holder
        """What the holder wrote into the lock file: ``pid``, ``host``, ``started`` (may be empty
        when it had not written it yet)."""


class RunLock:
    """``with RunLock(run_dir):`` holds ``run_dir/.lock`` for the block (``acquire``/``release``
    for longer lifetimes). Creates ``run_dir`` if needed; never blocks: a held lock raises
    ``RunDirLocked`` naming the holder's pid and host at once."""

    def __init__(self, run_dir: str | os.PathLike, name: str = LOCK_NAME):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / name
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "RunLock":
        if self._fd is not None:
            return self
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ValueError(f"run dir {self.run_dir} exists and is not a directory; pick another --run-dir")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _live_holder(fd)
                os.close(fd)
                raise RunDirLocked(_held_message(self.run_dir, self.path, holder), holder) from None
            except BaseException:
                os.close(fd)
                raise
            if _is_at(fd, self.path):
                break
            os.close(fd)  # a refused start removed the file after we opened it: lock the current one
        try:
            stale = _read_holder(fd)
            if stale:
                log.info("took over the lock %s left by pid %s on %s (started %s), which is no longer running",
                         self.path, stale.get("pid", "?"), stale.get("host", "?"), stale.get("started", "?"))
            _write_holder(fd)
        except BaseException:
            os.close(fd)   # closing the descriptor releases the flock
            raise
        self._fd = fd
        return self

    def release(self, remove: bool = False) -> None:
        """Empty the file (no holder) and drop the lock; a no-op when not held. ``remove``: delete
        the file first (a refused start, which must leave nothing behind)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if remove:
                self.path.unlink(missing_ok=True)
            else:
                os.ftruncate(fd, 0)
        except OSError:
            pass   # a full or read-only disk must not keep the lock: closing releases it anyway
        finally:
            os.close(fd)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
    # No __del__: a held lock whose object is dropped stays held until the process exits (its
    # descriptor is never closed), which is what "held for the whole run" needs.


def lock_run_dir(run_dir: str | os.PathLike, rank: int | None = None) -> RunLock | None:
    """Take the run directory's lock on rank 0 (``rank``, else ``$RANK``, else 0) and return it
    (held until ``release()`` or process exit); other ranks get None. For ``train`` to call
    before anything is written, and before ``init_process_group``."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    return RunLock(run_dir).acquire() if rank == 0 else None


def _is_at(fd: int, path: Path) -> bool:
    """The open file ``fd`` is the file at ``path`` (not one deleted since it was opened)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _read_holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _live_holder(fd: int, wait_s: float = 1.0) -> dict:
    """The holder of the (held) lock ``fd`` as it wrote itself into the file. Why wait: a run that
    has just taken the flock writes its pid a moment later, after reading the file's old content;
    a run started at the same moment would otherwise name nobody, or the dead previous holder
    whose pid is still in the file. So for up to ``wait_s`` re-read while the file is empty or
    names a process of this host that is not running."""
    deadline = time.monotonic() + wait_s
    while True:
        holder = _read_holder(fd)
        if (holder and (holder.get("host") != socket.gethostname() or _running(holder.get("pid")))) \
                or time.monotonic() > deadline:
            return holder
        time.sleep(0.01)


def _running(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def _write_holder(fd: int) -> None:
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    data = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}).encode() + b"\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _held_message(run_dir: Path, path: Path, holder: dict) -> str:
    if holder.get("pid") is not None:
        who = f"pid {holder['pid']} on host {holder.get('host', '?')} (started {holder.get('started', '?')})"
    else:
        who = "another process that is just starting"
    return (f"run dir {run_dir} is in use by {who}: two runs cannot share a run directory. Wait for it to end, "
            f"stop it, or pick another --run-dir (the lock is {path}, released when that process exits)")


__all__ = ["LOCK_NAME", "RunDirLocked", "RunLock", "lock_run_dir"]
