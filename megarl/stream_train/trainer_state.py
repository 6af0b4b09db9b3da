"""The trainer's weights and optimizer state in and out: this rank's pieces, the whole model under
Megatron or HF names (gathered over the model-parallel ranks), checkpoints and their resume, and the
check that a converted Megatron folder fits the trainer's layout. A mixin of
:class:`megarl.stream_train.trainer.Trainer`, which owns ``args``, ``cfg``, ``dims``, ``models``,
``optimizer``, ``lr`` and ``steps_done``.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from megarl.checkpoint.convert import read_meta
from megarl.models import mcore_mapping, mcore_sharding
from megarl.stream_train.model import load_state


class TrainerState:
    """Weights and optimizer state of a :class:`~megarl.stream_train.trainer.Trainer`."""

    def _check_mcore_layout(self, mcore_dir: str) -> None:
        """``mcore_dir`` holds this trainer's model in this trainer's layout."""
        meta, args = read_meta(mcore_dir)
        d = self.dims
        got, want = ({k: meta[k] for k in ("tp", "pp", "vpp", "ep")},
                     {"tp": d.tp, "pp": d.pp, "vpp": d.vpp, "ep": d.ep})
        if got != want:
            raise ValueError(f"{mcore_dir} was converted for trainer layout {got}; this trainer is {want}")
        if mcore_mapping.hf_shapes(args) != mcore_mapping.hf_shapes(self.args):
            raise ValueError(f"{mcore_dir} holds another model than this trainer's: {args.model_type} with tensor "
                             f"shapes differing from this {self.args.model_type}'s")

    def local_pieces(self) -> dict[int, dict[str, torch.Tensor]]:
        """This rank's weights by pipeline stage (``dims.stage(chunk)`` for each model chunk): each
        a local Megatron state dict (``mcore_sharding.shard_rank``'s layout of that stage), the
        tensors themselves (no copies)."""
        return {self.dims.stage(c): {k: v for k, v in m.module.state_dict().items() if not k.endswith("_extra_state")}
                for c, m in enumerate(self.models)}

    def mcore_state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the whole model's weights under Megatron names, on CPU, on every rank: with
        TP/PP the pieces of this rank's model-parallel group are all-gathered and merged
        (``mcore_sharding.merge``, which also checks that replicated tensors agree bitwise).
        Materialises the full model on each rank: for export and tests, not for the weight sync."""
        local = {stage: {k: v.detach().to("cpu", copy=True) for k, v in sd.items()}
                 for stage, sd in self.local_pieces().items()}
        dims = self.dims
        if dims.tp == 1 and dims.stages == 1 and dims.ep == 1:
            return local[0]
        if dims.ep == 1:
            pieces = [None] * (dims.tp * dims.pp)
            dist.all_gather_object(pieces, [((dims.tp_rank, stage), sd) for stage, sd in local.items()],
                                   group=dims.pg_collection.mp)
            return mcore_sharding.merge(dict(p for rank in pieces for p in rank), self.args, dims.tp, dims.stages)
        # With EP the expert pieces sit on other data-parallel ranks: gather from the whole world
        # and keep one copy of each (tp, pp, ep) piece (DP replicas hold equal ones).
        pieces = [None] * dims.trainer_world_size
        dist.all_gather_object(pieces, [((dims.tp_rank, stage, dims.ep_rank), sd) for stage, sd in local.items()],
                               group=dims.trainer_group)
        return mcore_sharding.merge(dict(p for rank in pieces for p in rank), self.args, dims.tp, dims.stages,
                                    ep=dims.ep)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights under HF names, in the model dtype, on CPU, on every rank
        (export, checkpoints and the single-process weight sync)."""
        return mcore_mapping.mcore_to_hf(self.mcore_state_dict(), self.args)

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint: Megatron-named model weights, Megatron optimizer state, lr, steps done. Deep
        copies, so later steps do not alter a checkpoint kept in memory."""
        return {
            # one local state dict per model chunk (one without virtual pipeline stages)
            "model": [{k: v.detach().clone() for k, v in sd.items()} for sd in self.local_pieces().values()],
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "steps_done": self.steps_done,
            "lr": self.lr,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the next ``train_step`` continues the saved run bitwise."""
        models = sd["model"] if isinstance(sd["model"], list) else [sd["model"]]  # a dict: before vpp
        if len(models) != len(self.models):
            raise ValueError(f"checkpoint holds {len(models)} model chunks per rank; this trainer has vpp="
                             f"{self.dims.vpp}: resume with the layout the run was saved with")
        for m, local in zip(self.models, models):
            load_state(m.module, local)
        self.optimizer.load_state_dict(copy.deepcopy(sd["optimizer"]))
        self.lr = float(sd.get("lr", self.cfg.lr))  # the lr in effect when saved
        self._apply_lr_and_wd()  # weight decay: this run's config
        self.steps_done = int(sd["steps_done"])
