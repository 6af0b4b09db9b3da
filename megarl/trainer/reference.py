"""The KL reference policy held like the policy: each trainer rank keeps only its own piece of the
reference weights (its TP rank's and pipeline stage's, as the trainer holds the policy), and the
reference logprobs are the trainer's own forward with those pieces swapped in for the policy's
(as slime does), never a whole plain-torch copy of the model per rank (docs/design.md §1.3: the
trainer's forward scores what the engine sampled; the reference is scored the same way).

The swap replaces each parameter's storage (``param.data``) by the reference piece for the forward
and puts the policy's back afterwards: no copy of either, the optimizer and gradient buffers are
untouched (the forward takes no gradient). Checkpoints keep ``ref.pt`` as before, the whole model
under HF names (gathered over the model-parallel ranks when written, and each rank's piece taken
from it when resumed), so checkpoints with a reference written before this module load unchanged.
"""
from __future__ import annotations

import contextlib

import torch

from megarl.trainer.model import load_hf_state


class ShardedReference:
    """The reference weights of this rank's model chunks, under the chunks' parameter names."""

    def __init__(self, trainer, hf_state: dict[str, torch.Tensor] | None = None):
        """``hf_state``: the whole reference under HF names (a checkpoint's ``ref.pt``); None: the
        trainer's weights now (the policy RL starts from)."""
        self.trainer = trainer
        self.pieces = [{name: p.detach().clone() for name, p in m.module.named_parameters()} for m in trainer.models]
        if hf_state is not None:
            with self._swapped():  # this rank's piece of hf_state, written into the reference's tensors
                for chunk, m in enumerate(trainer.models):
                    load_hf_state(m.module, hf_state, trainer.args, trainer.dims, chunk=chunk)

    @contextlib.contextmanager
    def _swapped(self):
        """The trainer's parameters hold the reference pieces inside the block, the policy's after."""
        params = [(p, piece[name]) for m, piece in zip(self.trainer.models, self.pieces)
                  for name, p in m.module.named_parameters()]
        policy = [p.data for p, _ in params]
        try:
            for p, ref in params:
                p.data = ref
            yield
        finally:
            for (p, _), data in zip(params, policy):
                p.data = data

    def token_logprobs(self, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Reference logprob of token t+1 at t, [B, T-1] in fp32, on every trainer rank of the
        replica (every rank of it passes the same ``input_ids``): the trainer's forward
        (:meth:`Trainer.token_logprobs`) on the reference weights."""
        with self._swapped():
            return self.trainer.token_logprobs(input_ids, temperature=temperature).float()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole reference under HF names, on every trainer rank (collective over the
        model-parallel group, as :meth:`Trainer.hf_state_dict`): for the checkpoint's ``ref.pt``."""
        with self._swapped():
            return self.trainer.hf_state_dict()

    def nbytes(self) -> int:
        """Bytes of the reference weights this rank holds."""
        seen, total = set(), 0
        for piece in self.pieces:
            for t in piece.values():
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
        return total
