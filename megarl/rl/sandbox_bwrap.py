"""The bubblewrap (``bwrap``) command line that contains one sandboxed program (megarl/rl/sandbox.py).

Why bubblewrap: containing a process needs user, mount, PID and network namespaces, a new root
filesystem and read-only bind mounts, set up in the right order, without privileges. bwrap (the
Debian package ``bubblewrap``, used by Flatpak) does exactly that, is small and well reviewed;
the same by hand through ``ctypes`` would be ours to get right. Its cost is ~5 ms per program
(``benchmarks/bench_sandbox.py``).

What the program sees (everything else of the host does not exist for it):

- ``/usr`` and the Python installation (``sys.base_prefix``, where the interpreter and the stdlib
  live), read-only; ``/bin``, ``/lib*``, ``/sbin`` as on the host (symlinks into ``/usr`` on
  merged-/usr systems, else read-only binds). The installation's own ``site-packages`` is hidden
  behind an empty read-only folder (stdlib only, as ``-S`` intends). The trainer's virtualenv,
  home, run directory, ``/etc`` (``/etc/shadow``, ``/etc/passwd``), ``/root``, ``/home``, ``/work``
  are absent.
- its working directory: a private tmpfs of at most ``workdir_bytes`` at the path of the host
  temporary folder ``run_python`` made (which it never sees), holding a copy of ``main.py``;
  a fresh ``/tmp`` and ``/dev/shm`` (private tmpfs of at most ``scratch_bytes`` each); all three
  gone when the program ends, so everything it writes is at most ``workdir_bytes + 2 *
  scratch_bytes``, in memory (charged to its memory cgroup where it has one). The root and
  ``/dev`` are read-only.

Older bubblewrap (< 0.8: no ``--disable-userns``; < 0.5: no ``--size``) still contains the program;
it only loses that option's part (nested user namespaces, writable ``/tmp``).
- a new PID namespace: the program is PID 2 under bwrap's init; when the program exits or is
  killed, init exits and the kernel SIGKILLs every process left in the namespace, ``setsid()``
  grandchildren included (``--die-with-parent`` also ties it to the trainer).
- an empty network namespace (loopback only), a new IPC/UTS namespace, no capabilities, no new
  privileges, and no further user namespaces (``--disable-userns``).

Root inside: when the trainer runs as root, the program is uid 0 mapped to the host's root but
without any capability; on what it can see (read-only system files, its own folders) that gives
it nothing the mounts do not already forbid.
"""
from __future__ import annotations

import functools
import os
import shutil
import site
import subprocess
import sys
import sysconfig

_SEARCH_PATH = "/usr/bin:/bin:/usr/local/bin:/usr/sbin:/sbin"
_TOP_LEVEL = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def find_bwrap() -> str | None:
    """Path of the ``bwrap`` binary (``PATH``, then the usual system folders), or None."""
    return shutil.which("bwrap") or shutil.which("bwrap", path=_SEARCH_PATH)


@functools.lru_cache(maxsize=1)
def python_executable() -> str:
    """The real interpreter binary: a virtualenv's ``bin/python`` is a symlink into an
    installation the sandbox binds; the virtualenv itself is not bound."""
    return os.path.realpath(sys.executable)


@functools.lru_cache(maxsize=None)
def supports(bwrap: str, option: str) -> bool:
    """Whether this bwrap knows ``option`` (``--disable-userns`` and ``--size`` came with 0.8.0
    and 0.5.0; Ubuntu 22.04 ships 0.6.1)."""
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return f"{option} " in out.stdout + out.stderr


@functools.lru_cache(maxsize=1)
def _static_args() -> tuple[str, ...]:
    """The part of the command line that is the same for every program (computed once)."""
    bwrap = find_bwrap() or "bwrap"
    args = ["--unshare-all", "--unshare-user", *(["--disable-userns"] if supports(bwrap, "--disable-userns") else []),
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr"]
    for top in _TOP_LEVEL:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for root in _python_roots():
        args += ["--ro-bind", root, root]
    for hidden in _site_packages():
        args += ["--tmpfs", hidden, "--remount-ro", hidden]
    args += ["--proc", "/proc", "--dev", "/dev"]
    return tuple(args)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _python_roots() -> list[str]:
    """Folders outside ``/usr`` the interpreter needs: its installation prefix(es) and the folder
    of its binary when that is elsewhere."""
    roots: list[str] = []
    for path in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(python_executable())):
        path = os.path.realpath(path)
        if not any(_under(path, r) for r in ["/usr", *roots]):
            roots.append(path)
    return roots


def _site_packages() -> list[str]:
    """The installation's site-packages folders that exist inside a bound root."""
    base = os.path.realpath(sys.base_prefix)
    paths = {sysconfig.get_paths(vars={"base": base, "platbase": base})[k] for k in ("purelib", "platlib")}
    paths.update(site.getsitepackages([base]))
    bound = ["/usr", *_python_roots()]
    return sorted(p for p in paths if os.path.isdir(p) and any(_under(os.path.realpath(p), r) for r in bound))


def bwrap_command(bwrap: str, workdir: str, program_fd: int, workdir_bytes: int, scratch_bytes: int) -> list[str]:
    """``bwrap`` arguments up to and including ``--`` for a program working in ``workdir``: a
    private tmpfs of ``workdir_bytes`` at that path, with ``main.py`` copied in from
    ``program_fd``; ``/tmp`` and ``/dev/shm`` are private tmpfs of ``scratch_bytes`` each (tmpfs
    size 0 would mean unlimited: at least one page). A bwrap without ``--size`` cannot cap them:
    ``/tmp`` and ``/dev/shm`` stay read-only and the working directory is the host folder, bound
    read-write (capped per file only)."""
    def size(n: int) -> str:
        return str(max(int(n), 4096))
    if supports(bwrap, "--size"):
        scratch = ["--size", size(scratch_bytes), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                   "--size", size(scratch_bytes), "--tmpfs", "/tmp",
                   "--size", size(workdir_bytes), "--tmpfs", workdir, "--file", str(program_fd), f"{workdir}/main.py"]
    else:
        scratch = ["--remount-ro", "/dev", "--bind", workdir, workdir]
    return [bwrap, *_static_args(), *scratch, "--chdir", workdir, "--remount-ro", "/", "--"]


def exit_status(returncode: int) -> int:
    """bwrap exits with 128 + N when the program died of signal N (a shell's convention);
    return that as ``-N`` like ``subprocess`` does, other codes unchanged."""
    if 128 < returncode <= 128 + 64:
        return -(returncode - 128)
    return returncode


__all__ = ["bwrap_command", "exit_status", "find_bwrap", "python_executable"]
