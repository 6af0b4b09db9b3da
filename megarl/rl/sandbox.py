"""Running model-written Python in a contained subprocess, for rewards that execute code.

Threat model: the code comes from the policy being trained, so it is arbitrary and sometimes
pathological, but not a targeted attack. It may loop forever, allocate 10 GB, write a huge file,
print without end, fork children, open sockets, or crash. None of that may hang or crash the
trainer, leak its secrets, or reach the network; each call ends in bounded time with a
``SandboxResult`` that says what happened. This is resource containment, *not* a security
boundary against a determined attacker (for that use a VM, gVisor or nsjail); in particular run
the trainer as an unprivileged user: limits that root applies to itself it can often lift.

What each part guards:

- fresh interpreter ``sys.executable -I -S -B``: no user site, no ``PYTHON*`` variables, no
  current directory on ``sys.path``, no site-packages (stdlib only), no ``.pyc`` writes.
- fresh temporary working directory, deleted afterwards (``HOME`` and ``TMPDIR`` point there too),
  so files the program writes do not pile up or collide between concurrent runs.
- minimal environment (``PATH``, locale, ``HOME``/``TMPDIR``): the trainer's tokens and keys
  are not inherited.
- ``SandboxLimits.timeout_s`` (wall clock, enforced by the parent): infinite loops, sleeps and
  blocked reads. On expiry the whole process group gets SIGKILL (the child leads its own session,
  ``start_new_session=True``), so forked grandchildren die too. The group is killed after a
  normal exit as well: nothing the program started outlives the call. A grandchild that calls
  ``setsid()`` itself leaves the group and escapes this (a PID namespace or cgroup would catch it).
- ``cpu_s`` (RLIMIT_CPU): CPU burnt by one process, a backstop for the wall clock (SIGXCPU).
- ``memory_mb`` (RLIMIT_AS, address space): ``bytearray(10 * 1024**3)`` fails with MemoryError
  instead of pushing the node into swap or the OOM killer. It is per process, not per group.
- ``file_size_mb`` (RLIMIT_FSIZE): the largest file any process may write (Python ignores
  SIGXFSZ, so a write past it fails with EFBIG).
- ``max_output_bytes``: stdout and stderr are read incrementally and only their first
  ``max_output_bytes`` are kept; the rest is drained and dropped, so a print flood neither
  blocks the child on a full pipe nor grows the trainer's memory.
- RLIMIT_CORE = 0: crashes write no core files.
- network: see ``sandbox_network_isolation``.

Not limited: the number of processes. RLIMIT_NPROC counts *every* task (threads included) of
the real user id across the machine, so a cap low enough to stop a fork bomb would make the
sandbox fail to start beside a trainer with hundreds of threads, and root ignores it anyway;
the wall-clock kill of the process group is what ends a fork bomb.

How a result is classified (``SandboxResult.status``):
``ok`` exit 0; ``error`` other exit code (exception, failed assert, ``sys.exit(1)``);
``timeout`` killed at the wall-clock limit, or SIGXCPU at the CPU limit; ``memory`` an uncaught
MemoryError; ``file_size`` an uncaught EFBIG OSError or SIGXFSZ (a non-Python grandchild);
``killed`` any other signal (SIGSEGV, SIGKILL from the OOM killer or the hard CPU limit, ...).
The memory and file-size cases are reported by the bootstrap through reserved exit codes
(``EXIT_MEMORY``, ``EXIT_FILE_SIZE``), so a program that exits with those codes on purpose is
classified that way; it is not ``ok`` either way.

Thread safety: every call makes its own subprocess, directory, pipes and selector, and nothing
global is mutated except the once-computed isolation probe (under a lock); calls from many
threads at once are fine. No ``preexec_fn`` is used (it can deadlock a multi-threaded parent):
limits and isolation are applied by a small bootstrap in the child itself.
"""
from __future__ import annotations

import contextlib
import fcntl
import math
import numbers
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

EXIT_MEMORY = 211
"""Exit code the bootstrap uses for an uncaught MemoryError."""
EXIT_FILE_SIZE = 212
"""Exit code the bootstrap uses for an uncaught OSError(EFBIG) (write past RLIMIT_FSIZE)."""

STATUSES = ("ok", "error", "timeout", "memory", "file_size", "killed")

_MAIN = "main.py"
_DRAIN_GRACE_S = 1.0   # after the child is gone, how long to wait for the pipes to reach EOF
_POLL_S = 0.05          # exit polling period when pidfd_open is unavailable
_READ_CHUNK = 1 << 20
_PIPE_SIZE = 1 << 20    # a bigger pipe means fewer wake-ups while draining a print flood
_ENV_PATH = "/usr/local/bin:/usr/bin:/bin"

# Runs first in the child (``python -I -S -B -c _BOOTSTRAP mode mem cpu fsize``): network
# isolation, resource limits, then the program from main.py as ``__main__``. Kept to the stdlib
# and free of names the program could collide with (it runs in a fresh module namespace).
_BOOTSTRAP = r'''
import sys
def _megarl_boot():
    import errno, linecache, os, resource, traceback, types
    mode, mem, cpu, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    net = None
    if mode == "netns":
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            # CLONE_NEWUSER | CLONE_NEWNET: an empty network namespace (loopback only, down),
            # entered without privileges via a user namespace, which also leaves the program
            # no capabilities in the parent namespace (it cannot raise hard limits or setns back).
            if libc.unshare(0x10000000 | 0x40000000) == 0:
                net = "netns"
        except Exception:
            pass
    if net is None:
        blocked = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                   "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle"}
        def hook(event, args, _blocked=blocked):
            if event.startswith("socket.") or event in _blocked:
                raise PermissionError(f"sandbox: {event} is not allowed (no network, no exec)")
        sys.addaudithook(hook)
    def lower(which, soft, hard):
        _, cur_hard = resource.getrlimit(which)
        if cur_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(which, (soft, hard))
    lower(resource.RLIMIT_CORE, 0, 0)
    lower(resource.RLIMIT_CPU, cpu, cpu + 1)
    lower(resource.RLIMIT_FSIZE, fsize, fsize)
    with open("main.py", encoding="utf-8") as f:
        src = f.read()
    os.remove("main.py")
    linecache.cache["main.py"] = (len(src), None, src.splitlines(True), "main.py")
    lower(resource.RLIMIT_AS, mem, mem)
    mod = types.ModuleType("__main__")
    mod.__file__ = "main.py"
    sys.modules["__main__"] = mod
    sys.argv = ["main.py"]
    try:
        exec(compile(src, "main.py", "exec"), mod.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        code = 1
        if isinstance(e, MemoryError):
            code = %(mem_code)d
        elif isinstance(e, OSError) and e.errno == errno.EFBIG:
            code = %(fsize_code)d
        try:
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        except BaseException:
            pass
        sys.exit(code)
_megarl_boot()
''' % {"mem_code": EXIT_MEMORY, "fsize_code": EXIT_FILE_SIZE}


@dataclass
class SandboxLimits:
    """Limits for one ``run_python`` call (see the module docstring for what each guards)."""

    timeout_s: float = 5.0
    """Wall-clock limit in seconds, interpreter start-up included; the process group is killed
    when it expires."""
    cpu_s: int = 10
    """CPU-seconds per process (RLIMIT_CPU soft limit; SIGKILL one second later)."""
    memory_mb: int = 1024
    """Address space per process in MiB (RLIMIT_AS). Python itself needs ~30 MiB of it."""
    file_size_mb: int = 16
    """Largest file a process may write, in MiB (RLIMIT_FSIZE)."""
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
        _check_int("max_output_bytes", self.max_output_bytes, 0, "bytes")


def _check_int(name: str, value, minimum: int, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"SandboxLimits.{name} must be an integer >= {minimum} ({unit}), got {value!r}")


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


# ----------------------------------------------------------------------------------------------
# network isolation probe

_isolation: str | None = None
_isolation_lock = threading.Lock()


def sandbox_network_isolation() -> str:
    """How sandboxed programs are kept off the network on this machine, probed once per process:

    - ``"netns"``: the child enters a new, empty network namespace (unprivileged
      ``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` via ctypes in the bootstrap). Only a loopback
      device that is down exists, so connects fail with ENETUNREACH and DNS fails; this holds for
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
    global _isolation
    with _isolation_lock:
        if _isolation is None:
            _isolation = _probe_isolation()
        return _isolation


def _probe_isolation() -> str:
    try:
        ours = os.readlink("/proc/self/ns/net")
        probe = 'import os; print(os.readlink("/proc/self/ns/net"))'
        res = _run(probe, "", SandboxLimits(timeout_s=20.0), mode="netns")
        if res.ok and res.stdout.strip().startswith("net:") and res.stdout.strip() != ours:
            return "netns"
    except Exception:   # any failure to probe means: use the fallback, never crash the caller
        pass
    return "audit-hook"


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
    ``SandboxLimits()``), feeding it ``stdin``; never raises for anything the program does.
    Blocks for at most about ``limits.timeout_s`` + 1 s."""
    limits = limits if limits is not None else SandboxLimits()
    mode = "netns" if sandbox_network_isolation() == "netns" else "audit-hook"
    result = _run(code, stdin, limits, mode=mode)
    _notify(result)
    return result


def _run(code: str, stdin: str, limits: SandboxLimits, mode: str) -> SandboxResult:
    """``run_python`` with the isolation ``mode`` ("netns": try the namespace, fall back to the
    hook; "audit-hook": hook only) given explicitly (tests use it to exercise the fallback)."""
    workdir = tempfile.mkdtemp(prefix="megarl-sandbox-")
    try:
        with open(os.path.join(workdir, _MAIN), "w", encoding="utf-8") as f:
            f.write(code)
        with _stdin_file(stdin) as stdin_f:
            return _spawn_and_wait(workdir, stdin_f, limits, mode)
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


def _command(limits: SandboxLimits, mode: str) -> list[str]:
    mb = 1 << 20
    return [sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP, mode,
            str(limits.memory_mb * mb), str(limits.cpu_s), str(limits.file_size_mb * mb)]


def _environment(workdir: str) -> dict[str, str]:
    return {"PATH": _ENV_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def _spawn_and_wait(workdir: str, stdin_f, limits: SandboxLimits, mode: str) -> SandboxResult:
    start = time.monotonic()
    proc = subprocess.Popen(_command(limits, mode), cwd=workdir, env=_environment(workdir), stdin=stdin_f,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
    try:
        out = _Output(limits.max_output_bytes)
        timed_out = _pump_until_exit(proc, out, start + limits.timeout_s)
        seconds = time.monotonic() - start
        _kill_group(proc.pid)   # timeout, or stragglers after a normal exit
        _pump_to_eof(proc, out, time.monotonic() + _DRAIN_GRACE_S)
        returncode = proc.wait()
    except BaseException:
        _kill_group(proc.pid)
        proc.kill()
        proc.wait()
        raise
    finally:
        proc.stdout.close()
        proc.stderr.close()
    return SandboxResult(status=_classify(returncode, timed_out), returncode=None if timed_out else returncode,
                         stdout=out.text(0), stderr=out.text(1),
                         seconds=seconds, truncated=out.truncated)


class _Output:
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
                fcntl.fcntl(f.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
            pipes[f.fileno()] = i
    return pipes


def _pump_until_exit(proc: subprocess.Popen, out: _Output, deadline: float) -> bool:
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


def _pump_to_eof(proc: subprocess.Popen, out: _Output, deadline: float) -> None:
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


def _read_once(fd: int, pipes: dict[int, int], out: _Output) -> bool:
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


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _classify(returncode: int, timed_out: bool) -> str:
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


__all__ = ["EXIT_FILE_SIZE", "EXIT_MEMORY", "STATUSES", "SandboxLimits", "SandboxResult", "recorded_results",
           "run_python", "sandbox_network_isolation"]
