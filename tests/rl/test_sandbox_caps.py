"""Caps on a sandboxed program as a whole, not per process or per file (megarl/rl/sandbox.py):
the memory of all its processes together (a memory cgroup, megarl/rl/sandbox_cgroup.py) and the
size of everything it writes in its working directory (a tmpfs under bubblewrap)."""
import os
import time

import pytest

from megarl.rl import sandbox_bwrap, sandbox_cgroup
from megarl.rl.sandbox import SandboxLimits, run_python, sandbox_containment

REQUIRE_BWRAP = os.environ.get("MEGARL_REQUIRE_BWRAP") == "1"

# three children of 700 MiB each: every one is under a 1 GiB per-process cap, together they are not
_THREE_CHILDREN = """
import os, time
kids = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        b = bytearray(700 << 20)   # zero-filled: every page touched
        time.sleep(1.0)
        os._exit(0)
    kids.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids]
print(codes, flush=True)
assert codes == [0, 0, 0], codes
print("all allocated")
"""


def test_memory_cap_holds_for_the_processes_together():
    where = sandbox_cgroup.available()
    if isinstance(where, str):
        pytest.skip(f"no memory cgroup here ({where}): memory is capped per process only")
    res = run_python(_THREE_CHILDREN, limits=SandboxLimits(memory_mb=1024, timeout_s=30.0))
    assert res.status == "memory", (res.status, res.stdout, res.stderr[-500:])
    assert "all allocated" not in res.stdout
    # the same program under a cap that fits all three passes: the cap, not the program, failed it
    res = run_python(_THREE_CHILDREN.replace("700 << 20", "50 << 20"), limits=SandboxLimits(memory_mb=1024))
    assert res.ok and res.stdout.endswith("all allocated\n"), res.stderr[-500:]


def test_working_directory_is_capped_as_a_whole():
    if sandbox_containment() != "bwrap" and not REQUIRE_BWRAP:
        pytest.skip("bubblewrap (bwrap) is not installed or not usable here: `make sandbox`")
    if not sandbox_bwrap.supports(sandbox_bwrap.find_bwrap(), "--size"):
        pytest.skip("bwrap < 0.5 has no --size: the working directory is capped per file only")
    # 4 files of 10 MiB each, every one under the 16 MiB per-file cap, 40 MiB together
    code = ("for i in range(4):\n    open(f'f{i}', 'wb').write(b'x' * (10 << 20))\n    print(i, flush=True)")
    res = run_python(code, limits=SandboxLimits(workdir_mb=25, file_size_mb=16))
    assert res.status == "error" and "No space left on device" in res.stderr, (res.status, res.stderr[-300:])
    assert res.stdout.split() == ["0", "1"]   # 20 MiB fit in 25, the third file does not
    # the private /tmp and /dev/shm are tmpfs of file_size_mb each: a tree of small files stops there too
    code = ("import os\nfor d in ('/tmp', '/dev/shm'):\n    n = 0\n    try:\n"
            "        for i in range(100):\n            open(f'{d}/f{i}', 'wb').write(b'x' * (1 << 20))\n            n += 1\n"
            "    except OSError as e:\n        print(d, n, e.strerror)\n")
    res = run_python(code, limits=SandboxLimits(file_size_mb=4))
    assert res.ok and res.stdout.splitlines() == ["/tmp 4 No space left on device",
                                                  "/dev/shm 4 No space left on device"], res.stdout


def test_a_program_that_imitates_bwrap_failing_is_a_failing_program():
    # the parent tells a sandbox that did not start from a program by the bootstrap's start byte,
    # not by what the program prints
    if sandbox_containment() != "bwrap" and not REQUIRE_BWRAP:
        pytest.skip("bubblewrap (bwrap) is not installed or not usable here: `make sandbox`")
    res = run_python("import sys\nsys.stderr.write('bwrap: Can\\'t mount proc\\n')\nsys.exit(1)")
    assert (res.status, res.returncode) == ("error", 1)


def test_limits_validation_of_workdir_mb():
    with pytest.raises(ValueError, match="SandboxLimits.workdir_mb"):
        SandboxLimits(workdir_mb=0)


def test_without_bwrap_the_memory_cgroup_still_ends_a_setsid_grandchild(tmp_path):
    # no PID namespace here: the grandchild leaves the process group, but not the cgroup
    from megarl.rl import sandbox as sb
    if isinstance(sandbox_cgroup.available(), str):
        pytest.skip("no memory cgroup here")
    late = tmp_path / "late"
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1.5)\n"
            f"    open({str(late)!r}, 'w').write('escaped')\n    os._exit(0)\nprint('started')")
    res = sb._run(code, "", SandboxLimits(), mode="audit-hook")
    assert res.ok and res.stdout == "started\n", res.stderr
    time.sleep(2.5)
    assert not late.exists()
