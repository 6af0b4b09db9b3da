import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megarl.rl import sandbox as sb
from megarl.rl import sandbox_bwrap
from megarl.rl.sandbox import (EXIT_FILE_SIZE, EXIT_MEMORY, SandboxLimits, SandboxUnavailable, recorded_results,
                               run_python, sandbox_containment, sandbox_network_isolation)

LEGACY_MODES = ["netns", "audit-hook"]   # no PID namespace: pids printed inside are the host's
MODES = ["bwrap", *LEGACY_MODES]
# CI installs bubblewrap (.ci/run): there the contained mode must run, not skip.
REQUIRE_BWRAP = os.environ.get("MEGARL_REQUIRE_BWRAP") == "1"


def _skip_unless(mode):
    if mode == "bwrap" and sandbox_containment() != "bwrap":
        if REQUIRE_BWRAP:
            pytest.fail("MEGARL_REQUIRE_BWRAP=1 but bubblewrap cannot contain programs here")
        pytest.skip("bubblewrap (bwrap) is not installed or not usable here")
    if mode == "netns" and sb._legacy_isolation() != "netns":
        pytest.skip("user + network namespaces are not available here")


def _run_mode(mode, code, limits=None, stdin=""):
    """Run under an explicit containment mode; skipped where this machine cannot do it."""
    _skip_unless(mode)
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


@pytest.mark.parametrize("mode", LEGACY_MODES)
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


@pytest.mark.parametrize("mode", LEGACY_MODES)
def test_normal_exit_also_kills_leftover_children_without_waiting_for_them(mode):
    t0 = time.monotonic()
    res = _run_mode(mode, _FORK_GRANDCHILD.format(rest="sys.exit(0)"), SandboxLimits(timeout_s=10.0))
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
        # audit hook: refused in Python; netns: loopback down; bwrap: its own loopback, no listener
        want = {"audit-hook": "PermissionError", "netns": "OSError", "bwrap": "ConnectionRefusedError"}[mode]
        assert want in res.stderr
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


@pytest.mark.parametrize("mode", ["bwrap", "netns"])
def test_netns_also_covers_programs_that_bypass_python(mode):
    # a grandchild binary would not carry an audit hook; in a network namespace it has no route either
    code = ("import subprocess, sys\n"
            "r = subprocess.run([sys.executable, '-c', "
            "'import socket; socket.create_connection((\"1.1.1.1\", 53), timeout=2)'], capture_output=True)\n"
            "print(r.returncode, r.stderr.decode().strip().splitlines()[-1])")
    res = _run_mode(mode, code, SandboxLimits(timeout_s=10.0))
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
    names = ["HOME", "LANG", "LC_ALL", "PATH", *(["PWD"] if sandbox_containment() == "bwrap" else []), "TMPDIR"]
    assert res.stdout.splitlines() == [str(names), "None"]


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
        assert sb._legacy_isolation() == "netns"
        assert sandbox_network_isolation() == "netns"


# ----------------------------------------------------------------------------------------------
# containment: each escape below works without bubblewrap (the tests fail when
# run_python falls back to "netns"), and is contained with it.

def _processes_with(marker: str) -> list[int]:
    """Host pids of live processes whose command line contains ``marker``."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read() and _alive(int(d)):
                        found.append(int(d))
            except OSError:
                pass
    return found


def test_writes_outside_the_workdir_are_contained(tmp_path):
    _skip_unless("bwrap")
    nonce = secrets.token_hex(8)
    targets = [tmp_path / "escaped", Path.cwd() / f".megarl-escaped-{nonce}", Path(f"/tmp/megarl-escaped-{nonce}"),
               Path.home() / f".megarl-escaped-{nonce}", Path(sys.prefix) / f"escaped-{nonce}"]
    code = ("import os\nwritten = []\n"
            f"for p in {[str(t) for t in targets]!r} + ['mine.txt']:\n"
            "    try:\n        open(p, 'w').write('x')\n        written.append(p)\n"
            "    except OSError as e:\n        print(p, e.strerror)\n"
            "print('WROTE', written)")
    try:
        res = run_python(code)
        assert res.ok, res.stderr
        assert not [t for t in targets if t.exists()], res.stdout
        # only its own folder and its private /tmp (gone with the sandbox; read-only on bwrap < 0.5) were writable
        private_tmp = [str(targets[2])] if sandbox_bwrap.supports(sandbox_bwrap.find_bwrap(), "--size") else []
        assert res.stdout.splitlines()[-1] == f"WROTE {private_tmp + ['mine.txt']}"
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


def test_trainer_files_are_not_readable(tmp_path):
    _skip_unless("bwrap")
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    home = Path.home()
    home_file = next((p for p in sorted(home.iterdir()) if p.is_file()), None)
    hidden_site = sandbox_bwrap._site_packages()
    paths = [str(secret), "/etc/shadow", "/etc/passwd", str(Path.cwd() / "README.md"), sys.prefix,
             *([str(home_file)] if home_file else []), *hidden_site]
    code = ("import os\n"
            f"for p in {paths!r}:\n"
            "    try:\n"
            "        got = os.listdir(p) if os.path.isdir(p) else open(p).read()\n"
            "        print('SEEN' if got else 'EMPTY', p)\n"
            "    except OSError as e:\n"
            "        print('DENIED', p)\n"
            f"print(sorted(os.listdir({str(home)!r})) if os.path.isdir({str(home)!r}) else [])\n")
    res = run_python(code)
    assert res.ok, res.stderr
    *lines, home_listing = res.stdout.splitlines()
    seen = dict(reversed(line.split(" ", 1)) for line in lines)
    assert {p: seen[p] for p in paths} == {**{p: "DENIED" for p in paths}, **{p: "EMPTY" for p in hidden_site}}
    assert "hunter2" not in res.stdout
    # the home shows at most the way to the Python installation (here ~/.pyenv), nothing else
    python_root = Path(sandbox_bwrap.python_executable()).resolve()
    allowed = [python_root.relative_to(home).parts[0]] if python_root.is_relative_to(home) else []
    assert home_listing == str(allowed)


@pytest.mark.parametrize("ending", ["exit", "timeout"])
def test_setsid_grandchild_does_not_outlive_the_program(tmp_path, ending):
    """A grandchild that leaves the process group (setsid), sleeps, then writes a file: without a
    PID namespace it survives the group kill and writes it; in one it dies with the program."""
    _skip_unless("bwrap")
    nonce = f"megarl-survivor-{secrets.token_hex(8)}"
    late = tmp_path / "late"
    sleeper = f"import time; time.sleep(2.5); open({str(late)!r}, 'w').write('escaped')"
    code = ("import os, sys, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            f"    os.execv(sys.executable, [sys.executable, '-c', {sleeper!r}, {nonce!r}])\n"
            "time.sleep(0.3)\nprint('started', flush=True)\n"
            + ("time.sleep(60)\n" if ending == "timeout" else ""))
    t0 = time.monotonic()
    try:
        res = run_python(code, limits=SandboxLimits(timeout_s=1.0 if ending == "timeout" else 10.0))
        assert res.status == ("timeout" if ending == "timeout" else "ok"), res.stderr
        assert res.stdout == "started\n"
        deadline = time.monotonic() + 0.5   # the kernel kills a PID namespace before its init is reaped
        while _processes_with(nonce) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert time.monotonic() - t0 < 2.0, "too slow to tell a survivor from a sleeper"
        assert _processes_with(nonce) == [], "the setsid grandchild outlived the sandbox"
        time.sleep(max(0.0, t0 + 3.5 - time.monotonic()))   # past the moment it would have written
        assert not late.exists()
    finally:
        for pid in _processes_with(nonce):
            os.kill(pid, signal.SIGKILL)


def test_a_normal_program_still_passes_when_contained():
    _skip_unless("bwrap")
    code = ("import json, multiprocessing, os, subprocess, sys, tempfile\n"
            "with tempfile.NamedTemporaryFile('w', delete=False) as f:\n    f.write('data')\n"
            "open('/tmp/scratch', 'w').write('ok')\n"
            "r = subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True)\n"
            "with multiprocessing.Pool(2) as pool:\n    squares = pool.map(abs, [-1, -2])\n"
            "print(json.dumps([open(f.name).read(), open('/tmp/scratch').read(), r.stdout.strip(), squares]))")
    res = run_python(code, limits=SandboxLimits(timeout_s=20.0))
    assert res.ok, res.stderr
    assert res.stdout == '["data", "ok", "42", [1, 2]]\n'
    from megarl.rl.reward_pool import python_tests_reward
    assert python_tests_reward("```python\ndef add(a, b):\n    return a + b\n```", "assert add(2, 3) == 5") == 1.0
    assert python_tests_reward("```python\ndef add(a, b):\n    return a - b\n```", "assert add(2, 3) == 5") == 0.0


def test_private_tmp_is_capped_and_memory_limit_holds_in_bwrap():
    _skip_unless("bwrap")
    if not sandbox_bwrap.supports(sandbox_bwrap.find_bwrap(), "--size"):
        pytest.skip("bwrap < 0.5 has no --size: /tmp stays read-only")
    code = ("for i in range(8):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * 2**20)\n    print(i, flush=True)")
    res = _run_mode("bwrap", code, SandboxLimits(file_size_mb=3, timeout_s=10.0))
    assert res.status == "error" and "No space left on device" in res.stderr   # a 3 MiB tmpfs, not RAM
    assert res.stdout.split() == ["0", "1", "2"]   # 3 MiB fit, the 4th does not
    res = _run_mode("bwrap", "b = bytearray(10 * 1024**3)", SandboxLimits(memory_mb=256))
    assert (res.status, res.returncode) == ("memory", EXIT_MEMORY)


def test_bwrap_exit_status_maps_signals():
    assert sandbox_bwrap.exit_status(128 + signal.SIGSEGV) == -signal.SIGSEGV
    assert sandbox_bwrap.exit_status(128 + signal.SIGXCPU) == -signal.SIGXCPU
    assert [sandbox_bwrap.exit_status(c) for c in (0, 1, 3, 128, EXIT_MEMORY)] == [0, 1, 3, 128, EXIT_MEMORY]


def test_bwrap_that_cannot_start_is_an_error_not_a_failing_program(monkeypatch):
    _skip_unless("bwrap")
    broken = (*sandbox_bwrap._static_args(), "--ro-bind", "/nonexistent-megarl-path", "/x")
    monkeypatch.setattr(sandbox_bwrap, "_static_args", lambda: broken)
    with pytest.raises(SandboxUnavailable, match="bubblewrap could not start the sandbox: bwrap: "):
        sb._run("print('hi')", "", SandboxLimits(), mode="bwrap")


def test_without_bwrap_one_warning_says_what_is_not_contained(monkeypatch, caplog):
    monkeypatch.setattr(sb, "_probed", {})
    monkeypatch.setattr(sandbox_bwrap, "find_bwrap", lambda: None)
    with caplog.at_level(logging.WARNING, logger="megarl.rl.sandbox"):
        assert sandbox_containment() in LEGACY_MODES
        assert run_python("print(1)").ok
        assert sandbox_containment() in LEGACY_MODES
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    for words in ("bubblewrap (bwrap) is not installed", "NOT contained", "write anywhere", "/etc/shadow",
                  "setsid()", "apt-get install bubblewrap"):
        assert words in warnings[0]


def test_containment_is_bwrap_where_ci_installs_it():
    if REQUIRE_BWRAP:
        assert sandbox_containment() == "bwrap"
    assert sandbox_containment() in ("bwrap", *LEGACY_MODES)
    assert sandbox_network_isolation() == ("audit-hook" if sandbox_containment() == "audit-hook" else "netns")
