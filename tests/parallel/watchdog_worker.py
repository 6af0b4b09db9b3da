"""One rank of tests/parallel/test_watchdog.py, launched by plain subprocess (srun without torchrun)
or by torchrun; joins the world from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT.

usage: watchdog_worker.py CASE INTERVAL_S TIMEOUT_S READY_DIR
CASE: ``raise_<r>`` (rank r raises RuntimeError("boom"), the other keeps running collectives),
``collectives`` (both run collectives until the test kills or stops one),
``finish_late_<r>`` (rank r finishes 3 * TIMEOUT_S after the other, which destroys its process
group even before stopping the watchdog).
Each rank writes READY_DIR/rank<r> once the watchdog runs and the world has met.
"""
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.parallel.watchdog import RankWatchdog, WatchdogConfig


def collectives(seconds: float) -> None:
    """all_reduce in a loop: with a peer gone this fails or blocks in gloo (for the 30-min group
    timeout) until the watchdog ends the process. Bounded so a broken watchdog cannot outlive the test."""
    t, end = torch.ones(1), time.monotonic() + seconds
    while time.monotonic() < end:
        dist.all_reduce(t)
        time.sleep(0.01)


def main() -> None:
    case, interval_s, timeout_s, ready = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(minutes=30))
    with RankWatchdog(WatchdogConfig(interval_s=interval_s, timeout_s=timeout_s)):
        dist.barrier()
        (ready / f"rank{rank}").write_text(str(os.getpid()))
        if case.startswith("raise_"):
            if rank == int(case.rsplit("_", 1)[1]):
                raise RuntimeError("boom")
            collectives(120)
        elif case == "collectives":
            collectives(120)
        elif case.startswith("finish_late_"):
            if rank == int(case.rsplit("_", 1)[1]):
                time.sleep(3 * timeout_s)
            else:  # on rank 0 this would take the store down, but the watchdog holds it until stop()
                dist.destroy_process_group()
        else:
            raise ValueError(f"unknown case {case!r}")
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"rank {rank} finished", flush=True)


if __name__ == "__main__":
    main()
