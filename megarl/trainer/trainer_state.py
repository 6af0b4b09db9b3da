"""The trainer's weights and optimizer state in and out: this rank's pieces, the whole model under
Megatron or HF names (gathered over the model-parallel ranks), checkpoints and their resume, and the
check that a converted Megatron folder fits the trainer's layout. A mixin of
:class:`megarl.trainer.trainer.Trainer`, which owns ``args``, ``cfg``, ``dims``, ``models``,
``optimizer``, ``lr`` and ``steps_done``.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from megarl.checkpoint.convert import load_piece, read_meta
from megarl.models import mcore_mapping, mcore_sharding
from megarl.models.config import ModelArgs
from megarl.trainer import dist_ckpt, dist_convert
from megarl.trainer.model import load_state


class TrainerState:
    """Weights and optimizer state of a :class:`~megarl.trainer.trainer.Trainer`."""

    def _check_mcore_layout(self, mcore_dir: str) -> None:
        """``mcore_dir`` holds this trainer's model in this trainer's layout (a torch_dist folder:
        this trainer's model, in any layout)."""
        if dist_convert.is_torch_dist(mcore_dir):
            args = ModelArgs.from_hf_config(dist_convert.checkpoint_hf_config(mcore_dir))
            if mcore_mapping.hf_shapes(args) != mcore_mapping.hf_shapes(self.args):
                raise ValueError(f"{mcore_dir} holds another model than this trainer's: {args.model_type} with "
                                 f"tensor shapes differing from this {self.args.model_type}'s")
            return
        meta, args = read_meta(mcore_dir)
        d = self.dims
        got, want = ({k: meta[k] for k in ("tp", "pp", "vpp", "ep")},
                     {"tp": d.tp, "pp": d.pp, "vpp": d.vpp, "ep": d.ep})
        if got != want:
            raise ValueError(f"{mcore_dir} was converted for trainer layout {got}; this trainer is {want}")
        if mcore_mapping.hf_shapes(args) != mcore_mapping.hf_shapes(self.args):
            raise ValueError(f"{mcore_dir} holds another model than this trainer's: {args.model_type} with tensor "
                             f"shapes differing from this {self.args.model_type}'s")

    def _load_mcore_start(self, model, mcore_dir: str, chunk: int) -> None:
        """Starting weights of model chunk ``chunk``: this rank's piece of a ``megarl convert
        hf-to-mcore`` folder of this layout, or its part of a torch_dist folder (``megarl convert
        hf-to-torch-dist``, a run's trainer checkpoint: Megatron reshards it; collective)."""
        if dist_convert.is_torch_dist(mcore_dir):
            dist_convert.load_model_weights(model, mcore_dir)
        else:
            d = self.dims
            load_state(model, load_piece(mcore_dir, d.tp_rank, d.pp_rank, d.ep_rank, vp=chunk if d.vpp > 1 else None))

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
        copies, so later steps do not alter a checkpoint kept in memory. With the distributed
        optimizer the optimizer's state is its DP-independent part (param groups, step) and
        ``optimizer_shard``: this data-parallel rank's shard of the master weights and moments
        (each DP rank's differs; megarl/checkpoint/rl_state.py writes every rank's)."""
        sd = {
            # one local state dict per model chunk (one without virtual pipeline stages)
            "model": [{k: v.detach().clone() for k, v in sd.items()} for sd in self.local_pieces().values()],
            "optimizer": copy.deepcopy(self.optimizer.state_dict()) if self._stepped() else None,
            "steps_done": self.steps_done,
            "lr": self.lr,
        }
        if self.cfg.distributed_optimizer:
            sd["optimizer_shard"] = {"dp": self.dims.dp, "dp_rank": self.dims.dp_rank,
                                     "state": [_shard_state(opt) for opt in self._optimizers()]
                                     if self._stepped() else None}
        return sd

    def checkpoint_state(self):
        """What an RL checkpoint holds of this trainer (``trainer.checkpoint_format``): a Megatron
        distributed checkpoint folder (megarl/trainer/dist_ckpt.py), which resumes on another
        TP/PP/DP layout, or :meth:`state_dict` (one file per model-parallel piece, this layout).
        The folder needs every process to train (Megatron's save is collective over the whole
        world) and no virtual pipeline stages (untried there)."""
        if self.cfg.checkpoint_format != "torch_dist":
            return self.state_dict()
        if self.dims.vpp > 1 or self.dims.trainer_world_size != dist.get_world_size():
            raise ValueError(f"trainer.checkpoint_format=torch_dist needs every process to train (colocated placement) "
                             f"and parallel.trainer_vpp=1; this run has vpp={self.dims.vpp} and "
                             f"{self.dims.trainer_world_size} of {dist.get_world_size()} processes training: use "
                             f"trainer.checkpoint_format=pieces")
        return dist_ckpt.TrainerFolder(self)

    def master_weights(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Copies of the optimizer's fp32 master weights (this rank's shards with the distributed
        optimizer) by model parameter; empty when the weights are their own masters (fp32, fp64)."""
        return {p: p.main_param.detach().clone() for m in self.models for p in m.module.parameters()
                if getattr(p, "main_param", None) is not None}

    def restore_master_weights(self, masters: dict[torch.nn.Parameter, torch.Tensor]) -> None:
        """Write :meth:`master_weights`' copies back into the (same layout's) optimizer."""
        with torch.no_grad():
            for p, main in masters.items():
                p.main_param.copy_(main)

    def _stepped(self) -> bool:
        """The optimizer has state (it took a step). A fresh distributed optimizer's state_dict
        fails (Megatron reads the step count from the moments): its checkpoint says None, fresh."""
        return not self.cfg.distributed_optimizer or any(opt.optimizer.state for opt in self._optimizers())

    def _optimizers(self) -> list:
        """The Megatron optimizers under the (chained) optimizer."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def optimizer_state_bytes(self) -> int:
        """Bytes of the optimizer's tensors on this rank: Adam's moments and the fp32 master
        weights where they are copies (bf16; with the distributed optimizer its master shards,
        which in fp32 are views of the weights and not counted)."""
        seen, total = set(), 0
        weights = {t.untyped_storage().data_ptr() for m in self.models for t in m.module.parameters()}
        for opt in self._optimizers():
            inner = opt.optimizer
            tensors = [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t)]
            tensors += [p for group in inner.param_groups for p in group["params"]]
            for t in tensors:
                ptr = t.untyped_storage().data_ptr()
                if t.dim() and ptr not in weights and (ptr, t.storage_offset()) not in seen:
                    seen.add((ptr, t.storage_offset()))
                    total += t.numel() * t.element_size()
        return total

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (or, with ``dist_folder`` in ``sd``, the distributed checkpoint
        folder there, written in any layout); the next ``train_step`` continues the saved run
        (bitwise in the layout that saved it)."""
        if "dist_folder" in sd:
            dist_ckpt.load_trainer(self, sd["dist_folder"])
            return
        models = sd["model"] if isinstance(sd["model"], list) else [sd["model"]]  # a dict: before vpp
        if len(models) != len(self.models):
            raise ValueError(f"checkpoint holds {len(models)} model chunks per rank; this trainer has vpp="
                             f"{self.dims.vpp}: resume with the layout the run was saved with")
        for m, local in zip(self.models, models):
            load_state(m.module, local)
        self._check_optimizer_kind(sd)
        if sd["optimizer"] is None:  # saved before the optimizer's first step
            self._build_optimizer()
        else:
            self.optimizer.load_state_dict(copy.deepcopy(sd["optimizer"]))
        if self.cfg.distributed_optimizer and sd["optimizer"] is not None:
            with torch.no_grad():  # (fp32: the master shards are views of the weights, which require grad)
                for opt, state in zip(self._optimizers(), sd["optimizer_shard"]["state"]):
                    opt.load_parameter_state_from_dp_reshardable(copy.deepcopy(state))
                    # Without apex/TE, DistributedOptimizer.load_state_dict gives every parameter the
                    # same ``step`` tensor, which torch's Adam then increments once per parameter:
                    # from the next step on the bias correction would be wrong. One each.
                    for param_state in opt.optimizer.state.values():
                        if torch.is_tensor(param_state.get("step")):
                            param_state["step"] = param_state["step"].clone()
        self.lr = float(sd.get("lr", self.cfg.lr))  # the lr in effect when saved
        self._apply_lr_and_wd()  # weight decay: this run's config
        self.steps_done = int(sd["steps_done"])

    def _check_optimizer_kind(self, sd: dict[str, Any]) -> None:
        """The checkpoint's optimizer state is of this trainer's kind and, sharded, of its DP size
        and rank."""
        shard = sd.get("optimizer_shard")
        if (shard is not None) != self.cfg.distributed_optimizer:
            saved = "with" if shard is not None else "without"
            raise ValueError(f"the checkpoint was written {saved} trainer.distributed_optimizer; this run has "
                             f"trainer.distributed_optimizer={self.cfg.distributed_optimizer}: resume with "
                             f"trainer.distributed_optimizer={shard is not None}")
        if shard is not None and (shard["dp"], shard["dp_rank"]) != (self.dims.dp, self.dims.dp_rank):
            raise ValueError(f"the checkpoint's optimizer shard is data-parallel rank {shard['dp_rank']} of "
                             f"{shard['dp']}; this process is rank {self.dims.dp_rank} of {self.dims.dp}: a run with "
                             f"trainer.distributed_optimizer resumes with the data-parallel size it was saved with")


def _shard_state(opt) -> dict:
    """A distributed optimizer's shard (master weights and moments per parameter, by bucket), as
    copies, in the form its ``load_parameter_state_from_dp_reshardable`` reads back."""
    state = opt.get_parameter_state_dp_reshardable()
    for key, by_dtype in state.items():
        if isinstance(key, int):
            for buckets in by_dtype.values():
                for bucket in buckets:
                    for i, entry in enumerate(bucket):
                        # clones, not deep copies: a master shard (fp32) views the whole weight buffer
                        bucket[i] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in entry.items()}
                        bucket[i]["padding"] = False  # every entry is a parameter's range
    return copy.deepcopy(state)
