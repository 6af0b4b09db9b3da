"""``python tests/fault_launch.py ARGS...``: ``megarl ARGS...`` (the real CLI) that SIGKILLs itself at
one chosen moment, for tests/test_faults.py.

Why a launcher instead of ``kill -9`` from the test after a sleep: a moment like "while the
trainer file of checkpoint 2 is written but its state.json is not" lasts milliseconds; only the
process itself can die there every time. The kill is still a real SIGKILL (no handler, no
``finally``, no flush), so what is on disk is what a ``kill -9`` at that moment leaves.

``MEGARL_FAULT`` picks the moment (steps are 1-based, as in metrics.jsonl):
  ``rollout:N:K``     when the K-th sample of step N's rollout finishes (other samples still generating);
  ``checkpoint:N``    inside checkpoint N's write: the trainer file written into the temporary
                      directory, ``state.json`` not yet;
  ``after_line:N``    right after step N's metrics.jsonl / timeline.jsonl lines (before any checkpoint of N);
  ``after_step:N``    right after step N's ``run_step`` returns on every process (torchrun: with
                      ``MEGARL_FAULT_RANK`` only on that rank);
  ``export``          inside the final export, after the weights, before the tokenizer and the rename;
  ``sft:N``           when SFT step N's batch is built (steps 1-based; N - 1 SFT steps done).
``MEGARL_FAULT_DIR`` (optional): each process writes ``pid.<rank>`` there at start, and the dying
process ``killed.<rank>`` holding ``time.time()`` just before the kill.
"""
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RANK = os.environ.get("RANK", "0")
MARKS = Path(os.environ["MEGARL_FAULT_DIR"]) if os.environ.get("MEGARL_FAULT_DIR") else None


def die() -> None:
    if MARKS is not None:
        (MARKS / f"killed.{RANK}").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def install(fault: str) -> None:
    kind, *nums = fault.split(":")
    n = [int(x) for x in nums]
    only_rank = os.environ.get("MEGARL_FAULT_RANK")
    if only_rank is not None and only_rank != RANK:
        return
    import megarl.train as train

    if kind == "rollout":
        from megarl.rollout.scoring import Scoring
        from megarl.rollout.stage import RolloutStage

        run, on_finish, seen = RolloutStage.run, Scoring.on_finish, {"step": None, "k": 0}

        def run_hook(self, uids, step, *a, **kw):
            seen["step"] = step + 1  # run_step's step is 0-based
            return run(self, uids, step, *a, **kw)

        def on_finish_hook(self, i, result):
            on_finish(self, i, result)
            if seen["step"] == n[0]:
                seen["k"] += 1
                if seen["k"] == n[1]:
                    die()

        RolloutStage.run, Scoring.on_finish = run_hook, on_finish_hook
    elif kind == "checkpoint":
        import torch

        from megarl.checkpoint import rl_state

        write = rl_state._write

        def write_hook(tmp, name, trainer_state, meta, ref_state):
            if meta["step"] == n[0]:
                torch.save(trainer_state, tmp / name)
                die()
            write(tmp, name, trainer_state, meta, ref_state)

        rl_state._write = write_hook
    elif kind == "after_line":
        write_step = train._write_step

        def write_step_hook(run_dir, cfg, result, *a, **kw):
            write_step(run_dir, cfg, result, *a, **kw)
            if result.metrics["step"] == n[0]:
                die()

        train._write_step = write_step_hook
    elif kind == "after_step":
        run_step = train.run_step

        def run_step_hook(run, step):
            out = run_step(run, step)
            if step + 1 == n[0]:
                die()
            return out

        train.run_step = run_step_hook
    elif kind == "sft":
        from megarl.stages import sft

        sft_batch, calls = sft.sft_batch, []

        def sft_batch_hook(*a, **kw):
            calls.append(1)
            if len(calls) == n[0]:
                die()
            return sft_batch(*a, **kw)

        sft.sft_batch = sft_batch_hook
    elif kind == "export":
        export_hf = train.export_hf

        def export_hook(trainer, out_dir, write_extra=None):
            return export_hf(trainer, out_dir, write_extra=lambda folder: die())

        train.export_hf = export_hook
    else:
        raise SystemExit(f"MEGARL_FAULT={fault!r}: unknown moment {kind!r} "
                         f"(valid: rollout:N:K, checkpoint:N, after_line:N, after_step:N, export, sft:N)")


if __name__ == "__main__":
    if MARKS is not None:
        (MARKS / f"pid.{RANK}").write_text(str(os.getpid()))
    if os.environ.get("MEGARL_FAULT"):
        install(os.environ["MEGARL_FAULT"])
    from megarl.cli import main

    sys.exit(main(sys.argv[1:]))
