"""The program that runs first in a sandboxed child (megarl/rl/sandbox.py): network isolation
where bubblewrap did not already provide it, resource limits, then the model-written program.

A string, run as ``python -I -S -B -c BOOTSTRAP mode mem cpu fsize started_fd``: it executes in
a fresh interpreter, so it may use only the stdlib and must not leave names the program could
collide with. Its first act is to write one byte to ``started_fd`` and close it: the parent then
knows the sandbox started, so a failure before that (bubblewrap's set-up, the cgroup) is the
sandbox's, not a program's, whatever the program later prints or exits with.
"""

EXIT_MEMORY = 211
"""Exit code the bootstrap uses for an uncaught MemoryError."""
EXIT_FILE_SIZE = 212
"""Exit code the bootstrap uses for an uncaught OSError(EFBIG) (write past RLIMIT_FSIZE)."""

# Runs first in the child (``python -I -S -B -c _BOOTSTRAP mode mem cpu fsize started_fd``): network
# isolation (mode "bwrap": already done by bubblewrap's namespaces), resource limits, then the
# program from main.py as ``__main__``. Kept to the stdlib and free of names the program could
# collide with (it runs in a fresh module namespace).
BOOTSTRAP = r'''
import sys
def _megarl_boot():
    import errno, linecache, os, resource, traceback, types
    mode, mem, cpu, fsize, started = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    os.write(started, b"1")
    os.close(started)
    net = "bwrap" if mode == "bwrap" else None
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
