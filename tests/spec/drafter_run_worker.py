"""Worker for test_drafter_runs.py: whole GRPO runs with the learned drafter on, through
tests/parallel_run_worker.py's ``run`` (its tiny fp64 runs, its ``resume_at`` stop-and-resume).

argv = (out_dir, run, [run ...]), each run ``name=key=value,...`` as in parallel_run_worker.py.
Besides what a run writes, every process appends one line per RL step to
``out_dir/<name>/drafter_rank<r>.jsonl``, taken right after the step's drafter training and
averaging (``BubblePolicy.drafter_after_rollout``, megarl/sched/policy.py): a digest of the drafter's weights (their exact
bytes) and of the fresh init's, its training-step count, and its loss on a fixed batch (the first batch this process drew,
kept for the whole run) with the current weights and with the fresh init's.

The speculator's clock is replaced by one that advances a fixed tick per reading: the bandit's reward
(tokens per second from proposing to the end of the engine step) becomes tokens per engine step, a function
of the samples and drafts only, so its choices are repeatable and a resumed run can be compared with
the uninterrupted one choice by choice. Only the bandit reads that clock."""
import hashlib
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.simplefilter("ignore")  # Megatron warns about missing apex/TE at import

import megarl.spec.speculator as speculator_module
import megarl.sched.policy as policy_module
import tests.parallel_run_worker as run_worker
from megarl.spec.drafter import Drafter


class _TickClock:
    """``time`` for the speculator: every ``perf_counter()`` reading is one tick after the previous.
    A tick is 2**-10 s, so that the difference of two readings is exactly one tick whatever the
    readings (with 1e-3 the rounding of t2 - t1 depends on t, which differs between a resumed and
    an uninterrupted run)."""

    def __init__(self):
        self.n = 0

    def perf_counter(self) -> float:
        self.n += 1
        return self.n * 2.0 ** -10


_current: dict = {}  # the run in progress: its directory, the fixed batch and the init's drafter
_after_rollout = policy_module.BubblePolicy.drafter_after_rollout


def _digest(model: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def _recorded_after_rollout(self, spec, tl, groups_dp) -> dict:
    out = _after_rollout(self, spec, tl, groups_dp)
    src = spec.drafter if spec is not None else None
    if src is None or src.trainer is None:  # no drafter in this run
        return out
    target = src.target
    rank = dist.get_rank() if dist.is_initialized() else 0
    trainer = src.trainer
    if "batch" not in _current:  # drawn from (seed, step count): drawing it changes nothing in the run
        _current["batch"] = trainer.batch()
        with torch.random.fork_rng(devices=[]):  # the init DrafterSource.attach makes
            torch.manual_seed(src.cfg.seed)
            init = Drafter(target.args, src.cfg.window)
        _current["init"] = init.to(device=target.device, dtype=target.dtype).eval()
    with torch.no_grad():
        loss_now = float(trainer.loss(_current["batch"])[0])
        model, trainer.model = trainer.model, _current["init"]
        try:
            loss_init = float(trainer.loss(_current["batch"])[0])
        finally:
            trainer.model = model
    line = {"digest": _digest(src.model), "digest_init": _digest(_current["init"]), "train_steps": trainer.steps,
            "loss_fixed_batch": loss_now, "loss_fixed_batch_init": loss_init, "buffer_tokens": src.buffer.tokens}
    with open(_current["dir"] / f"drafter_rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    return out


def _main(out_dir: str, *specs: str) -> None:
    speculator_module.time = _TickClock()
    policy_module.BubblePolicy.drafter_after_rollout = _recorded_after_rollout
    run = run_worker.run

    def run_recorded(out: Path, spec: str) -> None:
        _current.clear()
        _current["dir"] = out / spec.partition("=")[0]
        _current["dir"].mkdir(parents=True, exist_ok=True)
        run(out, spec)

    run_worker.run = run_recorded  # its main() calls run() by its module-level name
    run_worker.main(out_dir, *specs)


if __name__ == "__main__":
    torch.set_num_threads(1)
    _main(*sys.argv[1:])
