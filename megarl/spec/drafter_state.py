"""The learned drafter's share of an RL checkpoint (docs/design.md §5): what a resumed run needs for its
drafter, its training and its strategy choices to continue exactly as in the uninterrupted run.

Per rollout replica, one file ``drafter_replica<r>.pt`` in the checkpoint directory
(megarl/checkpoint/rl_state.py writes it into the temporary directory that is renamed into place,
so it appears with the rest of the checkpoint or not at all). It holds:
- ``trainer``: the drafter's weights (identical on every replica: they are averaged after each
  step), its Adam state, and its training-step count (which seeds its batches);
- ``buffer``: the hidden-state training buffer, i.e. recent rollouts' target hidden states in the
  rollout dtype, at most ``spec.drafter.buffer_tokens x (hidden_size x dtype size + 8)`` bytes:
  33 MiB for configs/tiny.yaml (65536 tokens, H=128, fp32; the drafter's weights and Adam state
  are 2.7 MiB). It is kept, not dropped: the next training steps draw from it, so without it the
  resumed drafter would train on other data and its weights (and so its drafts, and so which
  rows each verify forward computes) would differ from the uninterrupted run's; samples would
  not (docs/design.md §1). A large target (H=4096, bf16) makes it 0.5 GiB per replica at 64k tokens:
  lower ``buffer_tokens`` there if checkpoint size matters;
- ``bandit``: the strategy bandit's statistics (``spec.drafter.strategy=bandit``);
- ``accept``: the speculator's running per-token acceptance rate of each draft kind. The cost
  rule and the ``combined`` strategy read them, so they decide how long each draft is.
Adam moments, buffer, bandit and rates are each replica's own (its own rollouts and timings).

Not covered here: the ``history`` and ``bubble`` draft sources' contents (earlier epochs'
responses, pre-generated drafts) are not in the checkpoint; with them on, a resumed run proposes
other drafts than the uninterrupted one at first (samples are unchanged).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
_FILE = re.compile(r"^drafter_replica(\d+)\.pt$")


def file_name(replica: int) -> str:
    return f"drafter_replica{replica}.pt"


def drafter_state(spec) -> dict[str, Any] | None:
    """The state of ``spec``'s (a ``Speculator``) drafter, or None if it has none or has not been
    built yet (it is built at the first generate call: before that there is nothing to keep)."""
    src = spec.drafter if spec is not None else None
    if src is None or src.trainer is None:
        return None
    return {"trainer": src.trainer.state_dict(), "buffer": src.buffer.state_dict(),
            "bandit": spec.bandit.state_dict() if spec.bandit is not None else None,
            # Speculator._accept: {(source, coupled): [accepted, rejected]} (decayed counts)
            "accept": [[name, coupled, acc, rej] for (name, coupled), (acc, rej) in spec._accept.items()]}


def drafter_files(spec, replica: int) -> dict[str, dict[str, Any]]:
    """``{file name: state}`` this process adds to an RL checkpoint (``save_checkpoint``'s
    ``rank_files``): its replica's drafter state, or nothing. The drafter runs only with rollout
    TP = 1 (``DrafterSource.attach``), so each process is its own replica and names are unique."""
    state = drafter_state(spec)
    return {file_name(replica): state} if state is not None else {}


def load_drafter_state(spec, engine, state: dict[str, Any]) -> None:
    """Put a saved state into ``spec``'s drafter (built now, for ``engine``, if it is not yet)."""
    src = spec.drafter
    src.attach(engine.draft_target())
    src.trainer.load_state_dict(state["trainer"])
    src.buffer.load_state_dict(state["buffer"], device=engine.device, dtype=engine.dtype)
    if spec.bandit is not None:
        if state["bandit"] is not None:
            spec.bandit.load_state_dict(state["bandit"])
        else:
            log.warning("the checkpoint holds no bandit statistics (written with another spec.drafter.strategy): "
                        "the bandit starts afresh")
    spec._accept = {(name, bool(coupled)): [float(acc), float(rej)] for name, coupled, acc, rej in state["accept"]}


def restore_drafter(engine, ckpt: str | Path, replica: int, step: int) -> int:
    """On resume from checkpoint ``ckpt`` (written after ``step`` RL steps): load this replica's
    drafter state into ``engine``'s speculator. Returns the drafter's training-step count (0 if nothing was
    restored). With another number of replicas than the checkpoint's, replica r takes saved
    replica ``r % saved``: the weights are the same everywhere; moments, buffer, bandit and rates
    are then another replica's (still exact samples; the drafter trains on another data split)."""
    spec = engine.spec
    if spec is None or spec.drafter is None:
        return 0
    ckpt = Path(ckpt)
    saved = sorted(int(m.group(1)) for p in ckpt.iterdir() if (m := _FILE.match(p.name)))
    if not saved:
        if step > 0:
            log.warning("checkpoint %s holds no drafter state (written without spec.drafter.enabled, or by an older "
                        "megarl): the drafter starts afresh; samples are unchanged, drafter weights and drafts differ "
                        "from an uninterrupted run", ckpt)
        return 0
    if saved != list(range(len(saved))):
        raise ValueError(f"checkpoint {ckpt}: drafter state files of replicas {saved}; expected 0..{len(saved) - 1} "
                         f"(an incomplete copy of the checkpoint?)")
    r = replica % len(saved)
    if r != replica:
        log.warning("checkpoint %s has drafter state of %d replicas; replica %d resumes from replica %d's",
                    ckpt, len(saved), replica, r)
    from megarl.checkpoint.rl_state import verify_checkpoint

    verify_checkpoint(ckpt, read=[file_name(r)])  # its recorded checksum, before the bytes are trusted
    # Our own file of tensors and plain python values: the safe loader suffices.
    state = torch.load(ckpt / file_name(r), map_location="cpu", weights_only=True)
    load_drafter_state(spec, engine, state)
    return spec.drafter.trainer.steps
