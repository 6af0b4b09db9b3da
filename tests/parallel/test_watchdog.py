"""Rank watchdog over real 2-process gloo worlds started with plain subprocess, the way srun
starts ranks without torchrun (no agent kills the survivors): a rank that raises, is killed or
hangs, or the store host dying, ends every process non-zero with a message naming the rank and
the cause; ranks finishing at different times all exit 0. Small intervals keep it fast: failures
are detected in about TIMEOUT_S; LIMIT_S (the bound asserted) is well under the 60 s required."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from megarl.parallel.watchdog import EXIT_CODE, RankWatchdog, WatchdogConfig

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("watchdog_worker.py")
INTERVAL_S, TIMEOUT_S = 0.25, 2.0
LIMIT_S = 15.0
pytestmark = pytest.mark.multiproc


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    return {**env, **extra}


class World:
    """Two ranks of watchdog_worker.py, each with its own env (RANK, MASTER_PORT, ...) and log."""

    def __init__(self, case: str, dir: Path):
        self.dir = dir
        self.dir.mkdir()
        port = str(_free_port())
        self.logs = [self.dir / f"rank{r}.log" for r in range(2)]
        self.procs = []
        for r in range(2):
            env = _env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            with open(self.logs[r], "w") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER), case, str(INTERVAL_S), str(TIMEOUT_S), str(self.dir)],
                    env=env, stdout=log, stderr=subprocess.STDOUT))

    def wait_ready(self, timeout: float = 90.0) -> None:
        end = time.monotonic() + timeout
        while not all((self.dir / f"rank{r}").exists() for r in range(2)):
            assert time.monotonic() < end, f"ranks never got ready:\n{self.output(0)}\n{self.output(1)}"
            assert all(p.poll() is None for p in self.procs), \
                f"a rank exited early:\n{self.output(0)}\n{self.output(1)}"
            time.sleep(0.05)

    def wait(self, ranks=(0, 1), timeout: float = LIMIT_S) -> list[float]:
        """Seconds until each of ``ranks`` exited; fails (killing everything) past ``timeout``."""
        return wait_exits([(self, r) for r in ranks], timeout)

    def output(self, r: int) -> str:
        return f"--- rank {r} (rc {self.procs[r].poll()}):\n" + self.logs[r].read_text()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_exits(procs: list[tuple[World, int]], timeout: float) -> list[float]:
    """Seconds until each (world, rank) exited, polled together; fails (killing them) past ``timeout``."""
    t0, exited = time.monotonic(), {}
    while len(exited) < len(procs):
        for w, r in procs:
            if (w, r) not in exited and w.procs[r].poll() is not None:
                exited[w, r] = time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            for w, _ in procs:
                w.kill()
            pytest.fail(f"still running after {timeout} s:\n" + "\n".join(w.output(r) for w, r in procs))
        time.sleep(0.02)
    return [exited[p] for p in procs]


@pytest.fixture
def worlds(tmp_path):
    started = []

    def start(case: str, name: str = "") -> World:
        started.append(World(case, tmp_path / (name or case)))
        return started[-1]

    yield start
    for w in started:
        w.kill()


def test_raising_rank_ends_every_rank(worlds):
    # Both ranks in turn, at once: rank 0 raising also hosts the store, so it keeps the store up
    # until rank 1 has read the cause (otherwise rank 1 would only see "lost the store").
    runs = {bad: worlds(f"raise_{bad}") for bad in (1, 0)}
    for w in runs.values():
        w.wait_ready()
    for bad, w in runs.items():
        good = 1 - bad
        t_good, t_bad = w.wait(ranks=(good, bad))
        out_good, out_bad = w.output(good), w.output(bad)
        assert w.procs[good].returncode == EXIT_CODE, out_good
        assert f"megarl[rank {good}]: rank {bad} failed: RuntimeError: boom; exiting" in out_good, out_good
        assert w.procs[bad].returncode == 1 and "RuntimeError: boom" in out_bad, out_bad  # the normal exception path
        assert max(t_good, t_bad) < LIMIT_S


def _kill_and_wait(worlds, victim: int) -> list[tuple[World, float]]:
    """Two worlds at once (they mostly wait): SIGKILL ``victim`` in one, SIGSTOP it in the other
    (hung, or its node vanished without closing sockets); returns (world, seconds the survivor
    took to exit) per world."""
    runs = [worlds("collectives", name) for name in ("killed", "hung")]
    for w in runs:
        w.wait_ready()
    for w, sig in zip(runs, (signal.SIGKILL, signal.SIGSTOP), strict=True):
        os.kill(w.procs[victim].pid, sig)
    return [(w, w.wait(ranks=(1 - victim,))[0]) for w in runs]


def test_dead_or_hung_rank_ends_the_others(worlds):
    # Killed: gloo fails at once ("Connection closed by peer", naming no rank), so the watchdog
    # waits for the heartbeat to go stale to name it. Hung: the sockets stay open and rank 0 would
    # block in all_reduce for the 30-min group timeout.
    for w, t in _kill_and_wait(worlds, victim=1):
        out0 = w.output(0)
        assert w.procs[0].returncode == EXIT_CODE, out0
        assert "megarl[rank 0]: rank 1 stopped heartbeating for" in out0, out0
        assert "(process died or hung); exiting" in out0, out0
        assert t < LIMIT_S, (t, out0)


def test_store_host_dead_or_hung_ends_the_others(worlds):
    # Killed: the store connection breaks at once. Hung: store calls block in recv whatever their
    # timeout, and the clock thread acts.
    for w, t in _kill_and_wait(worlds, victim=0):
        out1 = w.output(1)
        assert w.procs[1].returncode == EXIT_CODE, out1
        assert "megarl[rank 1]: lost the rendezvous store hosted by rank 0 (it died or hung)" in out1, out1
        assert t < LIMIT_S, (t, out1)


def test_ranks_finishing_at_different_times_exit_cleanly(worlds):
    # Both orders at once (the ranks mostly sleep): rank 1 late (rank 0, the store host, waits in
    # stop() for it) and rank 0 late (rank 1 finished, destroyed its group and left). The early
    # rank destroys its process group before it stops the watchdog: rank 0's store must survive.
    late1, late0 = worlds("finish_late_1"), worlds("finish_late_0")
    for w in (late1, late0):
        w.wait_ready()
    l1r0, l1r1, l0r0, l0r1 = wait_exits([(late1, 0), (late1, 1), (late0, 0), (late0, 1)], 3 * TIMEOUT_S + LIMIT_S)
    for w in (late1, late0):
        for r in range(2):
            out = w.output(r)
            assert w.procs[r].returncode == 0, out
            assert f"rank {r} finished" in out and "megarl[" not in out, out
    assert l1r0 > 3 * TIMEOUT_S - 1, (l1r0, l1r1)  # rank 0 (store host) waited in stop() for rank 1
    assert l0r1 + 2 * TIMEOUT_S < l0r0, (l0r0, l0r1)  # rank 1 left long before rank 0, which did not mind


def test_torchrun_raising_rank(tmp_path):
    """Under torchrun (its agent hosts the store) the run fails, and its failure summary names rank
    1's cause (the watchdog fills the torchelastic error files) whichever rank it calls the root."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
         "raise_1", str(INTERVAL_S), str(TIMEOUT_S), str(tmp_path)],
        env=_env(), capture_output=True, text=True, timeout=120, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    summary = out[out.index("Failures:"):]
    assert "traceback : rank 1 failed: RuntimeError: boom" in summary or \
        "traceback : megarl watchdog on rank 0: rank 1 failed: RuntimeError: boom" in summary, summary


def test_config_validation_and_world_of_one():
    with pytest.raises(ValueError, match="watchdog.timeout_s"):
        WatchdogConfig(interval_s=2.0, timeout_s=3.0)
    with pytest.raises(ValueError, match="watchdog.interval_s"):
        WatchdogConfig(interval_s=0.0)
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with RankWatchdog(WatchdogConfig()):
            assert not [t for t in threading.enumerate() if t.name.startswith("megarl-watchdog")]
        assert not dist.distributed_c10d._get_default_store().check(["megarl/watchdog/hb/0"])
    finally:
        dist.destroy_process_group()
