import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from megarl.rl import sandbox as sb
from megarl.rl.sandbox import (EXIT_FILE_SIZE, EXIT_MEMORY, SandboxLimits, recorded_results, run_python,
                               sandbox_network_isolation)

MODES = ["netns", "audit-hook"]


def _run_mode(mode, code, limits=None, stdin=""):
    """Run under an explicit isolation mode; netns is skipped where this machine cannot do it."""
    if mode == "netns" and sandbox_network_isolation() != "netns":
        pytest.skip("user + network namespaces are not available here")
    return sb._run(code, stdin, limits or SandboxLimits(), mode=mode)


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_dead(pid: int, within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return not _alive(pid)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


# a program that forks a sleeping grandchild, reports its pid, then does {rest}
_FORK_GRANDCHILD = """
import os, sys, time
pid = os.fork()
if pid == 0:
    time.sleep(60)
    os._exit(0)
print(pid, flush=True)
{rest}
"""


def test_ok_program_captures_stdout_and_stdin():
    res = run_python("import sys\nprint('hello', sys.stdin.read().upper())", stdin="world")
    assert res.status == "ok" and res.ok
    assert res.returncode == 0
    assert res.stdout == "hello WORLD\n"
    assert res.stderr == ""
    assert not res.truncated
    assert 0 < res.seconds < 5


def test_runs_as_main_with_stdlib_only():
    res = run_python("import json, sys\nprint(__name__, json.dumps([1]), 'numpy' in sys.modules)\n"
                     "try:\n    import numpy\nexcept ImportError:\n    print('no numpy')")
    assert res.ok, res.stderr
    assert res.stdout.split("\n")[:2] == ["__main__ [1] False", "no numpy"]


@pytest.mark.parametrize("mode", MODES)
def test_infinite_loop_times_out_and_process_group_dies(mode):
    t0 = time.monotonic()
    res = _run_mode(mode, _FORK_GRANDCHILD.format(rest="while True:\n    pass"), SandboxLimits(timeout_s=1.0))
    elapsed = time.monotonic() - t0
    assert res.status == "timeout"
    assert res.returncode is None
    assert 0.9 <= res.seconds < 2.0
    assert elapsed < 3.0
    grandchild = int(res.stdout.split()[0])
    assert _wait_dead(grandchild), f"grandchild {grandchild} survived the timeout"


def test_normal_exit_also_kills_leftover_children_without_waiting_for_them():
    t0 = time.monotonic()
    res = run_python(_FORK_GRANDCHILD.format(rest="sys.exit(0)"), limits=SandboxLimits(timeout_s=10.0))
    assert res.status == "ok"
    assert time.monotonic() - t0 < 3.0, "waited for the grandchild holding the pipes"
    assert _wait_dead(int(res.stdout.split()[0]))


def test_huge_allocation_is_a_memory_error_in_the_child_only():
    rss_before = _rss_kib()
    t0 = time.monotonic()
    res = run_python("b = bytearray(10 * 1024**3)\nprint('allocated')", limits=SandboxLimits(memory_mb=512))
    assert res.status == "memory"
    assert res.returncode == EXIT_MEMORY
    assert "MemoryError" in res.stderr
    assert "allocated" not in res.stdout
    assert time.monotonic() - t0 < 3.0
    assert _rss_kib() - rss_before < 50 * 1024


def test_memory_limit_also_stops_gradual_growth():
    res = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024**2))",
                     limits=SandboxLimits(memory_mb=256, timeout_s=10.0))
    assert res.status == "memory", res.stderr


def test_huge_file_is_stopped_at_the_size_limit_and_workdir_removed():
    code = ("import os\nprint(os.getcwd(), flush=True)\n"
            "with open('big.bin', 'wb') as f:\n"
            "    for i in range(1000):\n"
            "        f.write(b'x' * 2**20)\n        f.flush()\n"
            "        print(i, flush=True)\n")
    res = run_python(code, limits=SandboxLimits(file_size_mb=3, timeout_s=10.0))
    assert res.status == "file_size"
    assert res.returncode == EXIT_FILE_SIZE
    assert "File too large" in res.stderr          # OSError EFBIG: Python ignores SIGXFSZ
    lines = res.stdout.split()
    workdir, written = lines[0], [int(x) for x in lines[1:]]
    assert written == [0, 1, 2]                     # 3 MiB written, the 4th write failed
    assert os.path.basename(workdir).startswith("megarl-sandbox-")
    assert not os.path.exists(workdir)


def test_workdir_removed_even_when_made_unwritable():
    code = ("import os\nprint(os.getcwd())\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\n"
            "os.chmod('a/b', 0)\nos.chmod('a', 0)")
    res = run_python(code)
    assert res.ok, res.stderr
    assert not os.path.exists(res.stdout.strip())


@pytest.mark.parametrize("mode", MODES)
def test_socket_to_a_local_listener_never_connects(mode):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        code = ("import socket\n"
                f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "s.sendall(b'exfiltrated')\nprint('connected')")
        res = _run_mode(mode, code)
        assert res.status != "ok"
        assert "connected" not in res.stdout
        assert ("PermissionError" if mode == "audit-hook" else "OSError") in res.stderr
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()


@pytest.mark.parametrize("mode", MODES)
def test_dns_and_http_to_external_hosts_fail(mode):
    code = ("import socket, urllib.request\nfailed = 0\n"
            "try:\n    socket.getaddrinfo('example.com', 80)\nexcept OSError as e:\n"
            "    failed += 1\n    print('dns', type(e).__name__)\n"
            "try:\n    urllib.request.urlopen('http://example.com/', timeout=2)\nexcept OSError as e:\n"
            "    failed += 1\n    print('http', type(e).__name__)\n"
            "assert failed == 2, failed\n")
    res = _run_mode(mode, code, SandboxLimits(timeout_s=10.0))
    assert res.ok, res.stderr
    assert res.stdout.startswith("dns ") and "\nhttp " in res.stdout


def test_netns_also_covers_programs_that_bypass_python():
    # a grandchild binary would not carry an audit hook; in a network namespace it has no route either
    code = ("import subprocess, sys\n"
            "r = subprocess.run([sys.executable, '-c', "
            "'import socket; socket.create_connection((\"1.1.1.1\", 53), timeout=2)'], capture_output=True)\n"
            "print(r.returncode, r.stderr.decode().strip().splitlines()[-1])")
    res = _run_mode("netns", code, SandboxLimits(timeout_s=10.0))
    assert res.ok, res.stderr
    assert res.stdout.startswith("1 ") and "unreachable" in res.stdout


def test_audit_hook_fallback_blocks_exec_and_ctypes():
    res = _run_mode("audit-hook", "import subprocess\nsubprocess.run(['true'])")
    assert res.status == "error" and "subprocess.Popen is not allowed" in res.stderr
    res = _run_mode("audit-hook", "import ctypes")
    assert res.status == "error" and "ctypes.dlopen is not allowed" in res.stderr
    res = _run_mode("audit-hook", _FORK_GRANDCHILD.format(rest="os.waitpid(pid, 0)") .replace("time.sleep(60)", "pass"))
    assert res.ok, res.stderr   # fork stays allowed (the forked child keeps the hook)


def test_network_isolation_is_reported_and_real():
    mode = sandbox_network_isolation()
    assert mode in ("netns", "audit-hook")
    assert sandbox_network_isolation() == mode   # probed once
    res = run_python("import os; print(os.readlink('/proc/self/ns/net'))")
    assert res.ok
    assert (res.stdout.strip() != os.readlink("/proc/self/ns/net")) == (mode == "netns")


def test_exception_is_an_error_with_the_traceback():
    res = run_python("def f():\n    return 1 / 0\nf()")
    assert res.status == "error"
    assert res.returncode == 1
    assert "ZeroDivisionError" in res.stderr
    assert 'File "main.py", line 2' in res.stderr and "return 1 / 0" in res.stderr


def test_syntax_error_and_nonzero_exit_are_errors():
    assert run_python("def (:").status == "error"
    res = run_python("import sys; sys.exit(3)")
    assert (res.status, res.returncode) == ("error", 3)


def test_signals_are_classified():
    res = run_python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert (res.status, res.returncode) == ("killed", -signal.SIGSEGV)
    assert sb._classify(-signal.SIGXFSZ, False) == "file_size"
    assert sb._classify(-signal.SIGXCPU, False) == "timeout"
    assert sb._classify(-signal.SIGKILL, False) == "killed"
    assert sb._classify(0, True) == "timeout"


def test_cpu_limit_ends_a_cpu_bound_program():
    res = run_python("while True:\n    pass", limits=SandboxLimits(cpu_s=1, timeout_s=20.0))
    assert res.status == "timeout"
    assert res.returncode == -signal.SIGXCPU


def test_output_flood_is_truncated_without_hanging():
    limits = SandboxLimits(max_output_bytes=1 << 20, timeout_s=20.0)
    t0 = time.monotonic()
    res = run_python("import sys\nprint('x' * (100 << 20))\nsys.stderr.write('e' * (5 << 20))", limits=limits)
    assert time.monotonic() - t0 < 15.0
    assert res.status == "ok"
    assert res.truncated
    assert res.stdout == "x" * (1 << 20)
    assert res.stderr == "e" * (1 << 20)


def test_unbounded_output_until_timeout_is_bounded():
    res = run_python("while True:\n    print('y' * 4096)", limits=SandboxLimits(timeout_s=1.0, max_output_bytes=1000))
    assert res.status == "timeout"
    assert len(res.stdout) == 1000 and res.truncated


def test_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("MEGARL_FAKE_SECRET", "hunter2-token")
    res = run_python("import os\nprint(sorted(os.environ))\nprint(os.environ.get('MEGARL_FAKE_SECRET'))")
    assert res.ok
    assert "hunter2-token" not in res.stdout and "MEGARL_FAKE_SECRET" not in res.stdout
    assert res.stdout.splitlines() == ["['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR']", "None"]


def test_program_cannot_raise_its_limits_in_a_user_namespace():
    if sandbox_network_isolation() != "netns":
        pytest.skip("only the user namespace strips the program's capabilities")
    code = ("import resource\ns, h = resource.getrlimit(resource.RLIMIT_AS)\n"
            "resource.setrlimit(resource.RLIMIT_AS, (h * 2, h * 2))")
    res = run_python(code)
    assert res.status == "error" and "not allowed to raise maximum limit" in res.stderr


def test_concurrent_calls_from_threads():
    results = [None] * 6

    def work(i):
        with recorded_results() as seen:
            results[i] = (run_python(f"import time; time.sleep(0.05); print({i} * {i})"), len(seen))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (res, n_seen) in enumerate(results):
        assert res.ok and res.stdout == f"{i * i}\n"
        assert n_seen == 1   # each thread saw only its own run


def test_recorded_results_nest_and_stop_at_block_end():
    with recorded_results() as outer:
        run_python("pass")
        with recorded_results() as inner:
            run_python("raise SystemExit(2)")
    run_python("pass")
    assert [r.status for r in outer] == ["ok", "error"]
    assert [r.returncode for r in inner] == [2]


@pytest.mark.parametrize("field, value", [("timeout_s", 0), ("timeout_s", float("inf")), ("timeout_s", "5"),
                                          ("cpu_s", 0), ("cpu_s", 1.5), ("memory_mb", 16), ("memory_mb", True),
                                          ("file_size_mb", -1), ("max_output_bytes", -1)])
def test_limits_validation(field, value):
    with pytest.raises(ValueError, match=f"SandboxLimits.{field}"):
        SandboxLimits(**{field: value})


def test_unshare_probe_agrees_with_the_shell():
    """Documents what was probed: ``unshare -rn true`` succeeds exactly when netns is used."""
    try:
        shell_ok = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (FileNotFoundError, subprocess.TimeoutExpired):
        pytest.skip("no unshare binary")
    if shell_ok:
        assert sandbox_network_isolation() == "netns"
