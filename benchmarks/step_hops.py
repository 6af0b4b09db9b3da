"""Count the module hops of one RL step (docs/design.md §3), by tracing a real run.

A hop is a call from one megarl module into another (the nearest megarl frame up the stack is the
caller, so torch's decorators and the threads' start-up do not hide one); each (caller, callee)
pair counts once. Traced: the second step (steady state) of tests/parallel_run_worker.py's tiny
fp64 run on 2 processes (2 rollout replicas) with stream training and bubble work (stream
training, pre-generated bubble drafts), speculation with every draft source; every thread of the
step is traced (the bubble thread included). Rank 0's hops are printed, and written as JSON.

    python benchmarks/step_hops.py OUT_DIR [REPO]     # REPO: another checkout to count (default: this one)

It launches itself under torchrun (gloo, CPU); a few minutes on 2 cores.
"""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

RUN = ("hops=stream_train=true,spec.enabled=true,spec.bubble_pregen=true,spec.forward_cost_tokens=0,"
       "schedule.bubble_priority=normal")
TRACED_STEP = 1


def _module(filename: str, root: str) -> str | None:
    """``megarl/x/y.py`` for a file of the megarl package under ``root`` (ending in /), else None."""
    return filename[len(root):] if filename.startswith(root + "megarl/") else None


def _tracer(root: str, hops: set):
    def profile(frame, event, arg):
        if event != "call":
            return
        callee = _module(frame.f_code.co_filename, root)
        if callee is None:
            return
        up = frame.f_back
        while up is not None and _module(up.f_code.co_filename, root) is None:
            up = up.f_back
        if up is not None and (caller := _module(up.f_code.co_filename, root)) != callee:
            hops.add((caller, callee))
    return profile


def worker(out_dir: str, root: str) -> None:
    """Under torchrun: tests/parallel_run_worker.py's run, its step TRACED_STEP traced."""
    sys.path.insert(0, root)
    import megarl.stages.step as step_module
    import megarl.train as train_module
    from tests import parallel_run_worker

    hops: set = set()
    plain = step_module.run_step

    def traced(run, step):
        if step != TRACED_STEP:
            return plain(run, step)
        profile = _tracer(root + "/", hops)
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            return plain(run, step)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)

    train_module.run_step = traced  # train.py calls it by the name it imported
    parallel_run_worker.main(out_dir, RUN)
    if os.environ.get("RANK", "0") == "0":
        rows = sorted(hops)
        Path(out_dir, "hops.json").write_text(json.dumps(rows, indent=0))
        modules = {m for h in rows for m in h}
        print("\n".join(f"{a} -> {b}" for a, b in rows))
        print(f"{len(rows)} hops over {len(modules)} modules")


def main(out_dir: str, root: str | None = None) -> None:
    root = str(Path(root or Path(__file__).resolve().parents[1]).resolve())
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": root, "MEGARL_STEP_HOPS": "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    __file__, out_dir, root], env=env, check=True)


if __name__ == "__main__":
    if os.environ.get("MEGARL_STEP_HOPS") == "1":
        import torch

        torch.set_num_threads(1)
        worker(*sys.argv[1:3])
    else:
        main(*sys.argv[1:3])
