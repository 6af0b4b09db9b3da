"""Running model-written Python in a contained subprocess, for rewards that execute code.

Threat model: the code comes from the policy being trained, so it is arbitrary and sometimes
pathological, but not a targeted attack. It may loop forever, allocate 10 GB, write a huge file,
print without end, fork children, open sockets, read or write files outside its folder, or crash.
None of that may hang or crash the trainer, leak its secrets, reach the network or leave anything
behind; each call ends in bounded time with a ``SandboxResult`` that says what happened. Our
users run model-written code at scale, so containment is the default where the machine allows
it; it is still no defence against a kernel exploit (for that use a VM or gVisor).

Containment (``sandbox_containment()``, probed once per process):

- ``"bwrap"`` (bubblewrap installed and working: Debian package ``bubblewrap``): the program runs
  in new user, mount, PID, network, IPC and UTS namespaces (megarl/rl/sandbox_bwrap.py says
  exactly what it sees). It cannot write outside its temporary folder (read-only root; its folder,
  ``/tmp`` and ``/dev/shm`` are private size-limited tmpfs), cannot signal or connect to the
  trainer (its own PID, network and IPC namespaces; no host path holds a socket it could reach),
  cannot read the trainer's files (only ``/usr`` and the Python
  installation are mounted: no ``/etc/shadow``, home, run directory or virtualenv), and no
  descendant survives it (when its PID namespace's init dies the kernel kills every process in
  it, ``setsid()`` grandchildren included).
- ``"netns"`` / ``"audit-hook"`` (no usable bwrap): the program runs as the trainer's user with
  the limits below and network isolation only (``sandbox_network_isolation``). It CAN write
  anywhere the trainer can, read any file the trainer can, and a grandchild that calls
  ``setsid()`` leaves the process group and outlives the call (unless a memory cgroup holds
  it: ``memory_mb`` below); run as root, it can lift the
  limits root applies to itself (``netns`` takes its capabilities away). One warning says so at
  the first probe; install bubblewrap to close these.

What each part guards in every mode:

- fresh interpreter ``python -I -S -B``: no user site, no ``PYTHON*`` variables, no
  current directory on ``sys.path``, no site-packages (stdlib only), no ``.pyc`` writes.
- fresh temporary working directory, deleted afterwards (``HOME`` and ``TMPDIR`` point there too),
  so files the program writes do not pile up or collide between concurrent runs. Under bwrap it
  is a tmpfs of ``workdir_mb`` (all its files together); without, files are capped one by one.
- minimal environment (``PATH``, locale, ``HOME``/``TMPDIR``; bwrap adds ``PWD``): the trainer's
  tokens and keys are not inherited.
- ``SandboxLimits.timeout_s`` (wall clock, enforced by the parent): infinite loops, sleeps and
  blocked reads. On expiry the whole process group gets SIGKILL (the child leads its own session,
  ``start_new_session=True``), so forked grandchildren die too (under bwrap: its PID namespace
  with them). The group is killed after a normal exit as well: nothing the program started
  outlives the call, except, without bwrap, a grandchild that left the group with ``setsid()``.
- ``cpu_s`` (RLIMIT_CPU): CPU burnt by one process, a backstop for the wall clock (SIGXCPU).
- ``memory_mb`` (RLIMIT_AS, address space): ``bytearray(10 * 1024**3)`` fails with MemoryError
  instead of pushing the node into swap or the OOM killer. RLIMIT_AS is per process; where a
  memory cgroup can be made (megarl/rl/sandbox_cgroup.py: root or a delegated cgroup) the same
  ``memory_mb`` also caps the resident memory of all the program's processes together, tmpfs
  files included (three children of 700 MB do not fit 1 GB): the kernel's OOM killer ends them
  and the result is ``memory``. Where none can be made the cap is per process only (``make
  sandbox`` says which). The cgroup also catches, without bwrap, a ``setsid()`` grandchild: every
  process left in it is killed when the call ends.
- ``file_size_mb`` (RLIMIT_FSIZE): the largest file any process may write (Python ignores
  SIGXFSZ, so a write past it fails with EFBIG). Under bwrap it also caps the private ``/tmp``
  and ``/dev/shm`` (each a tmpfs of that size: they live in memory).
- ``max_output_bytes``: stdout and stderr are read incrementally and only their first
  ``max_output_bytes`` are kept; the rest is drained and dropped, so a print flood neither
  blocks the child on a full pipe nor grows the trainer's memory.
- RLIMIT_CORE = 0: crashes write no core files.

Not limited: the number of processes. RLIMIT_NPROC counts *every* task (threads included) of
the real user id across the machine, so a cap low enough to stop a fork bomb would make the
sandbox fail to start beside a trainer with hundreds of threads, and root ignores it anyway;
the memory cgroup (each process costs memory) and the wall-clock kill of the process group (or
PID namespace) are what end a fork bomb.

How a result is classified (``SandboxResult.status``):
``ok`` exit 0; ``error`` other exit code (exception, failed assert, ``sys.exit(1)``);
``timeout`` killed at the wall-clock limit, or SIGXCPU at the CPU limit; ``memory`` an uncaught
MemoryError, or a process killed by its memory cgroup's OOM killer; ``file_size`` an uncaught EFBIG OSError or SIGXFSZ (a non-Python grandchild);
``killed`` any other signal (SIGSEGV, SIGKILL from the OOM killer or the hard CPU limit, ...).
The memory and file-size cases are reported by the bootstrap through reserved exit codes
(``EXIT_MEMORY``, ``EXIT_FILE_SIZE``), so a program that exits with those codes on purpose is
classified that way; it is not ``ok`` either way. Under bwrap, a death by signal N reaches us as
exit code 128 + N (bwrap's convention) and is reported as ``-N``: a program that exits with
129..192 on purpose reads as killed by a signal.

Thread safety: every call makes its own subprocess, directory, pipes and selector, and nothing
global is mutated except the once-computed probes (under a lock); calls from many
threads at once are fine. No ``preexec_fn`` is used (it can deadlock a multi-threaded parent):
limits and isolation are applied by a small bootstrap in the child itself.
"""
from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from megarl.rl import sandbox_bwrap
from megarl.rl.sandbox_boot import EXIT_FILE_SIZE, EXIT_MEMORY
from megarl.rl.sandbox_spawn import STATUSES, SandboxResult, SandboxUnavailable, memory_group, spawn_and_wait
from megarl.rl.sandbox_spawn import classify as _classify  # noqa: F401 (tests classify exit codes through it)

log = logging.getLogger(__name__)

_MAIN = "main.py"

@dataclass
class SandboxLimits:
    """Limits for one ``run_python`` call (see the module docstring for what each guards)."""

    timeout_s: float = 5.0
    """Wall-clock limit in seconds, interpreter start-up included; the process group is killed
    when it expires."""
    cpu_s: int = 10
    """CPU-seconds per process (RLIMIT_CPU soft limit; SIGKILL one second later)."""
    memory_mb: int = 1024
    """Memory in MiB: the address space of each process (RLIMIT_AS; Python itself needs ~30 MiB
    of it) and, where a memory cgroup can be made (megarl/rl/sandbox_cgroup.py), the resident
    memory of all the program's processes together, tmpfs files included."""
    file_size_mb: int = 16
    """Largest file a process may write, in MiB (RLIMIT_FSIZE); also the size of the private
    ``/tmp`` and ``/dev/shm`` under bubblewrap."""
    workdir_mb: int = 64
    """Under bubblewrap: the size in MiB of the working directory (a private tmpfs), i.e. of all
    files the program writes there together."""
    max_output_bytes: int = 1 << 20
    """Bytes of stdout and of stderr kept (each); the rest is read and dropped."""

    def __post_init__(self):
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, numbers.Real) \
                or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"SandboxLimits.timeout_s must be a finite number of seconds > 0, "
                             f"got {self.timeout_s!r}")
        _check_int("cpu_s", self.cpu_s, 1, "CPU-seconds")
        _check_int("memory_mb", self.memory_mb, 64, "MiB (the interpreter alone needs ~30 MiB)")
        _check_int("file_size_mb", self.file_size_mb, 0, "MiB")
        _check_int("workdir_mb", self.workdir_mb, 1, "MiB")
        _check_int("max_output_bytes", self.max_output_bytes, 0, "bytes")


def _check_int(name: str, value, minimum: int, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"SandboxLimits.{name} must be an integer >= {minimum} ({unit}), got {value!r}")


# ----------------------------------------------------------------------------------------------
# containment and network isolation probes

_probed: dict[str, str] = {}
_probe_lock = threading.Lock()


def sandbox_containment() -> str:
    """How sandboxed programs are contained on this machine, probed once per process (module
    docstring): ``"bwrap"`` (filesystem, PID and network namespaces), else ``"netns"`` or
    ``"audit-hook"`` (network isolation only; the first probe then logs one warning naming what
    is not contained and how to fix it). Call it at start to get that warning early; otherwise
    the first ``run_python`` does."""
    with _probe_lock:
        if "containment" not in _probed:
            bwrap_problem = _bwrap_problem_locked()
            if bwrap_problem is None:
                _probed["containment"] = "bwrap"
            else:
                _probed["containment"] = _legacy_isolation_locked()
                log.warning(_not_contained_warning(bwrap_problem, _probed["containment"]))
        return _probed["containment"]


def containment_problem() -> str | None:
    """None when sandboxed programs are contained here (bubblewrap works), else why not, in words;
    probed once per process, without the warning :func:`sandbox_containment` logs (for a run's
    set-up, which refuses to start instead unless told otherwise)."""
    with _probe_lock:
        return _bwrap_problem_locked()


def _bwrap_problem_locked() -> str | None:
    if "bwrap_problem" not in _probed:
        _probed["bwrap_problem"] = _probe_bwrap() or ""
    return _probed["bwrap_problem"] or None


def sandbox_network_isolation() -> str:
    """How sandboxed programs are kept off the network on this machine:

    - ``"netns"``: the child runs in a new, empty network namespace: bubblewrap's
      (``sandbox_containment() == "bwrap"``: loopback only, up) or one the bootstrap enters with
      unprivileged ``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` via ctypes (loopback down). Connects
      to anything outside fail (ENETUNREACH / ECONNREFUSED) and DNS fails; this holds for
      grandchildren and for code that bypasses Python (ctypes, a ``curl`` binary). The user
      namespace also strips the program's capabilities in the parent namespace.
    - ``"audit-hook"`` (fallback where user namespaces are disabled): a ``sys.addaudithook``
      hook raises PermissionError on every ``socket.*`` audit event (creation, connect, bind,
      getaddrinfo, ...), on spawning programs (``subprocess.Popen``, ``os.system``,
      ``os.exec*``, ``os.posix_spawn``: a new interpreter or binary would not carry the hook;
      ``os.fork`` stays allowed, the hook survives it) and on ``ctypes`` loading libraries.
      This is best effort, not a wall: code that reaches raw memory or native code by another
      route (e.g. an extension module, ``/proc/self/mem``) can remove or step around the hook.

    If ``unshare`` fails in one child after the probe said ``"netns"`` (e.g. a namespace quota),
    that child installs the audit hook instead; a program never runs with neither.
    """
    return "audit-hook" if sandbox_containment() == "audit-hook" else "netns"


def _legacy_isolation() -> str:
    """What the bootstrap alone achieves without bubblewrap: ``"netns"`` or ``"audit-hook"``."""
    with _probe_lock:
        return _legacy_isolation_locked()


def _legacy_isolation_locked() -> str:
    if "legacy" not in _probed:
        _probed["legacy"] = _probe_netns()
    return _probed["legacy"]


def _probe_netns() -> str:
    try:
        ours = os.readlink("/proc/self/ns/net")
        probe = 'import os; print(os.readlink("/proc/self/ns/net"))'
        res = _run(probe, "", SandboxLimits(timeout_s=20.0), mode="netns")
        if res.ok and res.stdout.strip().startswith("net:") and res.stdout.strip() != ours:
            return "netns"
    except Exception:   # any failure to probe means: use the fallback, never crash the caller
        pass
    return "audit-hook"


def _probe_bwrap() -> str | None:
    """None when bubblewrap runs a probe program in its own PID, mount and network namespaces
    with a read-only root; else why not, in words."""
    if sandbox_bwrap.find_bwrap() is None:
        return "bubblewrap (bwrap) is not installed"
    kinds = ("pid", "mnt", "net")
    probe = f"import os\nprint(*[os.readlink('/proc/self/ns/' + k) for k in {kinds!r}], os.access('/', os.W_OK))"
    try:
        res = _run(probe, "", SandboxLimits(timeout_s=20.0), mode="bwrap")
    except Exception as exc:   # never crash the caller: fall back and say why
        return f"bwrap failed: {exc}"
    ours = [os.readlink(f"/proc/self/ns/{k}") for k in kinds]
    seen = res.stdout.split()
    if not res.ok or len(seen) != 4 or any(a == b for a, b in zip(seen, ours)) or seen[3] != "False":
        detail = (res.stderr.strip().splitlines() or [res.stdout.strip() or res.status])[-1]
        return f"bwrap did not contain a probe program ({res.status}: {detail})"
    return None


def _not_contained_warning(problem: str, isolation: str) -> str:
    net = ("an empty network namespace" if isolation == "netns"
           else "an audit hook against sockets and exec (best effort)")
    return (f"megarl sandbox: {problem}. Model-written programs run with time, CPU, memory and file-size "
            f"limits and {net}, but are NOT contained: they can write anywhere this process can, read any "
            f"file it can (the run directory, the home directory; /etc/shadow when run as root), and a "
            f"grandchild that calls setsid() outlives the call. Install bubblewrap to contain them "
            f"(Debian/Ubuntu: apt-get install bubblewrap; needs unprivileged user namespaces).")


# ----------------------------------------------------------------------------------------------
# result observers (lets a reward pool see every run made on its behalf)

_observers = threading.local()


@contextlib.contextmanager
def recorded_results() -> Iterator[list[SandboxResult]]:
    """Inside the block, every ``SandboxResult`` that ``run_python`` returns *in this thread* is
    also appended to the yielded list (blocks nest; each sees the runs made inside it). This is
    how ``RewardPool`` counts timeouts and measures durations of reward functions that call
    ``run_python`` themselves; runs made from other threads are not seen."""
    stack = getattr(_observers, "stack", None)
    if stack is None:
        stack = _observers.stack = []
    results: list[SandboxResult] = []
    stack.append(results)
    try:
        yield results
    finally:
        stack.pop()


def _notify(result: SandboxResult) -> None:
    for results in getattr(_observers, "stack", ()):
        results.append(result)


# ----------------------------------------------------------------------------------------------
# running

def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh isolated interpreter under ``limits`` (default
    ``SandboxLimits()``), feeding it ``stdin``; never raises for anything the program does (only
    ``SandboxUnavailable`` when bubblewrap itself fails to start).
    Blocks for at most about ``limits.timeout_s`` + 1 s."""
    limits = limits if limits is not None else SandboxLimits()
    result = _run(code, stdin, limits, mode=sandbox_containment())
    _notify(result)
    return result


def _run(code: str, stdin: str, limits: SandboxLimits, mode: str) -> SandboxResult:
    """``run_python`` with the containment ``mode`` given explicitly (tests use it to exercise
    each): "bwrap" (bubblewrap's namespaces), "netns" (the bootstrap tries a network namespace,
    falling back to the hook), "audit-hook" (hook only)."""
    workdir = tempfile.mkdtemp(prefix="megarl-sandbox-")
    try:
        main = os.path.join(workdir, _MAIN)
        with open(main, "w", encoding="utf-8") as f:
            f.write(code)
        with _stdin_file(stdin) as stdin_f, open(main, "rb") as program, memory_group(limits) as group:
            return spawn_and_wait(workdir, stdin_f, program.fileno(), group, limits, mode)
    finally:
        _remove_tree(workdir)


@contextlib.contextmanager
def _stdin_file(stdin: str):
    """Stdin as an anonymous file (not a pipe, so a program that never reads cannot block the
    parent on a full pipe), or /dev/null when empty."""
    if not stdin:
        yield subprocess.DEVNULL
        return
    with tempfile.TemporaryFile() as f:
        f.write(stdin.encode("utf-8"))
        f.seek(0)
        yield f


def _remove_tree(path: str) -> None:
    """``rmtree`` that also removes entries the program made unreadable (chmod 000)."""
    def fix_and_retry(func, p, _exc):
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, stat.S_IRWXU)
                shutil.rmtree(p, ignore_errors=True)
            else:
                func(p)
    shutil.rmtree(path, onerror=fix_and_retry)
    if os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)


__all__ = ["EXIT_FILE_SIZE", "EXIT_MEMORY", "STATUSES", "SandboxLimits", "SandboxResult", "SandboxUnavailable",
           "recorded_results", "run_python", "sandbox_containment", "sandbox_network_isolation"]
