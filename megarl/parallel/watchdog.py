"""Rank watchdog: a rank that dies, hangs or raises makes every process exit, naming it.

Without help, the survivors of a dead rank wait in their next collective for the process-group
timeout (30 min) or, on localhost, fail with gloo's "Connection closed by peer", which names no
rank. torchrun kills the siblings of a failed worker, but srun/mpirun-style launches do not.

Each rank runs a daemon thread that, every ``interval_s``, writes its heartbeat to the rendezvous
store that ``init_process_group`` already created (its own connection to it; no extra port, no
collectives) and reads everyone else's. Keys under ``megarl/watchdog/``:
- ``hb/<r>``: rank r's heartbeat counter, then ``done`` after a clean :meth:`RankWatchdog.stop`,
  or ``exit`` when r is going down because of a failure;
- ``abort``: the first failure, e.g. ``rank 1 failed: ValueError: bad``; the first writer wins,
  so every rank names the root cause, not the errors that followed from it.
A rank exits (``os._exit(EXIT_CODE)``, message on stderr) when ``abort`` is set, when a peer's
heartbeat has not advanced for ``timeout_s``, or when the store stops answering. A store whose
host froze or whose node vanished leaves the client blocked in recv, whatever the store's own
timeout says, so a second thread (the "clock") exits when no store call has completed for
``timeout_s``.

Teardown: rank 0 hosts the TCP store under env:// and tcp:// rendezvous, so it must outlive the
other ranks' use of it. :meth:`RankWatchdog.stop` therefore marks the rank ``done`` and, on rank 0
only, returns once every rank is ``done`` (a barrier over the store that still detects a dead
rank, unlike a collective barrier). Other ranks return at once and never touch the store again,
so rank 0 leaving afterwards cannot look like a failure to them. The watchdog also holds the
default group's store, so destroying the process group before ``stop()`` cannot take the store
server down early. A rank that exits without ``stop()`` is declared dead.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import distributed_c10d

EXIT_CODE = 70
"""Exit status of a rank stopped by the watchdog (sysexits.h EX_SOFTWARE)."""
STORE_HOST = 0
"""Rank whose process hosts the TCP store under env:// and tcp:// rendezvous."""
_PREFIX = "megarl/watchdog/"
_ABORT = "abort"
_DONE, _EXIT = b"done", b"exit"


@dataclass
class WatchdogConfig:
    """Heartbeat watchdog over the rendezvous store (megarl/parallel/watchdog.py)."""

    enabled: bool = True
    """Run the watchdog (it is a no-op in a world of one process)."""
    interval_s: float = 2.0
    """Seconds between heartbeats; also how often peers' heartbeats and failure reports are read."""
    timeout_s: float = 20.0
    """A peer whose heartbeat has not advanced for this long is declared dead (died or hung), and
    so is a store that has not answered for this long. Every rank exits within about
    timeout_s + 2 * interval_s of a failure, plus up to timeout_s on rank 0 while it keeps the
    store up for the others to read the cause: the defaults keep this under 45 s. Raise it if a
    rank may hold the GIL longer than this (the heartbeat is a Python thread)."""

    def __post_init__(self):
        from megarl.utils.dataclass_config import check_number

        check_number("watchdog.interval_s", self.interval_s, gt=0, note="seconds")
        check_number("watchdog.timeout_s", self.timeout_s, gt=0, note="seconds")
        if self.timeout_s < 2 * self.interval_s:
            raise ValueError(f"watchdog.timeout_s={self.timeout_s} must be >= 2 * watchdog.interval_s "
                             f"({2 * self.interval_s}): a late heartbeat must not look like a death")


def _key(rank: int) -> str:
    return f"hb/{rank}"


def _is_comm_error(exc: BaseException | None) -> bool:
    """A failed collective or store call: usually the consequence of a peer's failure, not a cause.
    Gloo raises plain RuntimeErrors whose message carries its source path (".../gloo/...")."""
    while exc is not None:
        if isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc).lower()):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _record_for_torchrun(message: str, details: str) -> None:
    """Under torchrun, leave the cause in the worker's error file (the protocol of torchelastic's
    ``@record``): its failure summary then shows it instead of "exitcode 70, traceback: N/A"."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": details, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


class RankWatchdog:
    """Start after ``init_process_group`` on every rank; use as a context manager around the run
    (or call :meth:`start`, then :meth:`stop` or :meth:`report_failure`)."""

    # Watchdogs started by this process so far: each one keeps its keys under its own number.
    # Every process starts the same ones in the same order (one per run), so the numbers agree,
    # and a rank that starts its next run's watchdog while rank 0 is still stopping the last one
    # (runs one after another in one process group) cannot overwrite the "done" rank 0 waits for.
    _sessions = 0

    def __init__(self, config: WatchdogConfig | None = None):
        self.cfg = config or WatchdogConfig()
        self.rank = self.world_size = 0
        self._store: dist.Store | None = None
        self._keepalive: dist.Store | None = None
        self._poller: threading.Thread | None = None
        self._clock: threading.Thread | None = None
        self._halt = threading.Event()  # the poller returns at its next tick
        self._clock_halt = threading.Event()
        self._finishing = False  # rank 0 in stop(): write "done", return once all ranks are done
        self._beats = 0
        self._last_ok = 0.0  # monotonic time the last store call returned
        self._peers: list[int] = []
        self._seen: dict[int, bytes | None] = {}  # last heartbeat value read per peer
        self._changed: dict[int, float] = {}  # monotonic time that value last changed
        self._present: set[int] = set()  # peers whose key exists (multi_get blocks on missing keys)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> RankWatchdog:
        if self._poller is not None:
            raise RuntimeError("RankWatchdog.start() called twice")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if not self.cfg.enabled or self.world_size == 1:
            return self
        self._keepalive = distributed_c10d._get_default_store()
        # A clone is a separate connection: the poller never shares a socket with the process
        # group, and its timeout (bounding waits) is not the group's 30 min.
        client = self._keepalive.clone()
        client.set_timeout(datetime.timedelta(seconds=self.cfg.timeout_s))
        RankWatchdog._sessions += 1
        self._store = dist.PrefixStore(f"{_PREFIX}{RankWatchdog._sessions}/", client)
        self._store.compare_set(_ABORT, "", "")  # create it empty (unless a failure is already there)
        self._beat()
        self._peers = [r for r in range(self.world_size) if r != self.rank]
        now = time.monotonic()
        self._changed = dict.fromkeys(self._peers, now)  # a peer that never beats is dead after timeout_s
        self._seen = dict.fromkeys(self._peers)
        self._poller = threading.Thread(target=self._poll_loop, name="megarl-watchdog", daemon=True)
        self._clock = threading.Thread(target=self._clock_loop, name="megarl-watchdog-clock", daemon=True)
        self._poller.start()
        self._clock.start()
        return self

    def stop(self) -> None:
        """Finish cleanly. On rank 0 (the store host) this returns once every rank has finished."""
        if self._poller is None:
            return
        if self.rank == STORE_HOST:
            self._finishing = True
            self._poller.join()  # the poller exits the process instead if a rank fails meanwhile
        else:
            self._halt.set()
            self._poller.join()
            try:  # after the join, so nothing reads the store once rank 0 may be leaving
                self._store.set(_key(self.rank), _DONE)
            except Exception as e:  # this rank's work is complete; a lost rank 0 reports its own failure
                self._say(f"could not mark this rank finished ({type(e).__name__}: {e})")
        self._close()

    def report_failure(self, exc: BaseException) -> None:
        """Publish this rank's exception so every other rank exits naming it; the caller re-raises.
        A failed collective is usually a peer's fault: first give the watchdog timeout_s to find
        that peer (it then exits the process naming it), and only then report the error itself."""
        if self._poller is None:
            return
        if _is_comm_error(exc):
            self._poller.join(self.cfg.timeout_s + 2 * self.cfg.interval_s)
        self._halt.set()
        self._poller.join()
        cause = summary = f"rank {self.rank} failed: {type(exc).__name__}: {str(exc)[:2000]}"
        try:  # the clock still runs: it ends this process if the store hangs here
            first = self._store.compare_set(_ABORT, "", cause).decode()
            self._store.set(_key(self.rank), _EXIT)
            if first != cause:  # another rank failed first: name it as the root cause
                summary = f"{first} (and then {cause})"
                self._say(summary)
        except Exception:  # the store is gone; raising the exception still ends this rank
            pass
        _record_for_torchrun(summary, summary + "\n" + "".join(traceback.format_exception(exc)))
        if self.rank == STORE_HOST:
            try:
                self._linger()
            except Exception:
                pass
        self._close()

    def __enter__(self) -> RankWatchdog:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
            self.stop()
        else:
            self.report_failure(exc)
        return False

    def _close(self) -> None:
        self._clock_halt.set()
        self._clock.join()
        self._poller = self._clock = self._keepalive = None

    # ---- the threads -----------------------------------------------------------------------
    def _poll_loop(self) -> None:
        while not self._halt.is_set():
            try:
                self._beat()
                abort, states = self._read()
            except Exception as e:  # a broken store connection never heals
                self._exit(self._store_lost(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"))
            cause = abort or self._stale_peer(states)
            if cause:
                self._exit(cause)
            if self._finishing and all(states.get(r) == _DONE for r in self._peers):
                return
            self._halt.wait(self.cfg.interval_s)

    def _clock_loop(self) -> None:
        """Store calls block forever on a frozen or vanished host: exit when none has returned lately."""
        tick = resumed = time.monotonic()
        while not self._clock_halt.wait(self.cfg.interval_s):
            now = time.monotonic()
            if now - tick > 2 * self.cfg.interval_s + 1.0:  # this process was not scheduled (stopped,
                resumed = now  # GIL held): not the store's fault; give the poller a fresh timeout_s
            tick = now
            silent = now - max(self._last_ok, resumed)
            if silent > self.cfg.timeout_s:
                cause = self._store_lost(f"no answer for {silent:.0f} s")
                self._say(f"{cause}; exiting")
                _record_for_torchrun(cause, cause)
                sys.stdout.flush()
                os._exit(EXIT_CODE)  # no store calls here: they would block too

    def _beat(self) -> None:
        self._beats += 1
        self._store.set(_key(self.rank), _DONE if self._finishing else str(self._beats))
        self._last_ok = time.monotonic()

    def _read(self) -> tuple[str, dict[int, bytes]]:
        """The abort message ('' if none) and every present peer's heartbeat value."""
        missing = [r for r in self._peers if r not in self._present]
        if missing and self._store.check([_key(r) for r in missing]):  # one call once all have started
            self._present.update(missing)
        for r in missing:
            if r not in self._present and self._store.check([_key(r)]):
                self._present.add(r)
        ranks = sorted(self._present)
        values = self._store.multi_get([_ABORT] + [_key(r) for r in ranks])
        now = self._last_ok = time.monotonic()
        states = dict(zip(ranks, values[1:], strict=True))
        for r, v in states.items():
            if v != self._seen[r]:
                self._seen[r], self._changed[r] = v, now
        return values[0].decode(), states

    def _stale_peer(self, states: dict[int, bytes]) -> str:
        now = time.monotonic()
        for r in self._peers:
            if states.get(r) not in (_DONE, _EXIT) and now - self._changed[r] > self.cfg.timeout_s:
                return f"rank {r} stopped heartbeating for {now - self._changed[r]:.0f} s (process died or hung)"
        return ""

    def _store_lost(self, detail: str) -> str:
        host = "torchrun's agent" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else f"rank {STORE_HOST}"
        return f"lost the rendezvous store hosted by {host} (it died or hung): {detail}"

    def _exit(self, cause: str) -> None:
        self._say(f"{cause}; exiting")
        _record_for_torchrun(cause, f"megarl watchdog on rank {self.rank}: {cause}")
        try:
            self._store.compare_set(_ABORT, "", cause)  # so every rank names the same root cause
            self._store.set(_key(self.rank), _EXIT)
            if self.rank == STORE_HOST:
                self._linger()
        except Exception:
            pass
        sys.stdout.flush()
        os._exit(EXIT_CODE)

    def _linger(self) -> None:
        """Rank 0 hosts the store: keep it up (at most timeout_s) until every peer has read the
        abort message, finished, or is dead, so they name the cause instead of 'lost the store'."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while time.monotonic() < deadline:
            _, states = self._read()
            if all(states.get(r) in (_DONE, _EXIT) or time.monotonic() - self._changed[r] > self.cfg.timeout_s
                   for r in self._peers):
                return
            time.sleep(self.cfg.interval_s / 4)

    def _say(self, text: str) -> None:
        sys.stderr.write(f"megarl[rank {self.rank}]: {text}\n")
        sys.stderr.flush()
