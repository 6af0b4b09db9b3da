"""The trainer's weights and optimizer state in Megatron-core's distributed checkpoint format
(``dist_checkpointing``, ``torch_dist`` backend), the format Megatron-LM writes and reads.

Every tensor is saved with its place in the whole model (``sharded_state_dict``: global shape and
this rank's offsets), so a folder written in one trainer layout loads in another: a run saved at
TP=2 x DP=1 resumes at TP=1 x DP=2 or at PP=2 (docs/design.md §5). The optimizer state goes the
same way (Megatron's ``optimizer.sharded_state_dict``): the plain optimizer's moments are saved by
parameter, the distributed optimizer's in Megatron's ``fully_reshardable`` layout (gathered over
DP into whole parameters at save), which reshards over TP, PP and DP alike.

Folder content (written by every trainer process together, torch.distributed.checkpoint files
plus Megatron's ``metadata.json`` and ``common.pt``):

- ``model`` (``model0``, ``model1``, ... with virtual pipeline stages): the GPTModel's tensors
  under Megatron's global names (``decoder.layers.3.mlp.linear_fc1.weight``, ...);
- ``optimizer``: Megatron's sharded optimizer state (absent before the optimizer's first step);
- ``megarl``: what the trainer needs beyond them (steps done, lr, dtype, optimizer kind), and the
  model's HF ``config.json`` (``megarl convert torch-dist-to-hf`` reads it).

A plain ``megatron.core.dist_checkpointing.load`` of the folder, with a Megatron model's
``sharded_state_dict()`` under ``model``, loads the weights outside megarl.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megarl.parallel.collectives import group_device

BACKEND = "torch_dist"
MEGARL_KEY = "megarl"


def _model_keys(trainer) -> list[str]:
    """Megatron-LM's names of the model chunks in a checkpoint (``model``, or ``model0``, ``model1``...)."""
    return ["model"] if len(trainer.models) == 1 else [f"model{c}" for c in range(len(trainer.models))]


def _sharded_state_dict(trainer, is_loading: bool, with_optimizer: bool) -> dict[str, Any]:
    sd: dict[str, Any] = {key: m.module.sharded_state_dict() for key, m in zip(_model_keys(trainer), trainer.models)}
    if with_optimizer:
        # the optimizer's tensors are named after the model parameters they belong to, so
        # that they reshard with them
        sd["optimizer"] = trainer.optimizer.sharded_state_dict(sd, is_loading=is_loading,
                                                               metadata=_optimizer_metadata(trainer))
    return sd


def _optimizer_metadata(trainer) -> dict[str, Any]:
    """How Megatron lays out the distributed optimizer's state: ``fully_reshardable`` (each
    parameter's whole master weight and moments, gathered over DP at save), the layout that
    reshards over TP, PP and DP (``fully_sharded_model_space`` would too, but Megatron-core
    0.16 refuses its flattened ranges; ``dp_reshardable`` reshards over DP only). The gather
    goes over NCCL on GPU; over a gloo DP group (CPU) Megatron's gloo variant is taken, which
    reads the group from ``data_parallel_group_gloo`` (the optimizers are built without gloo
    side groups, trainer.py): the DP group itself is that gloo group."""
    meta = {"distrib_optim_sharding_type": "fully_reshardable"}
    if trainer.cfg.distributed_optimizer:
        for opt in trainer._optimizers():
            if group_device(opt.data_parallel_group).type == "cpu":
                meta["distrib_optim_fully_reshardable_mem_efficient"] = True
                opt.data_parallel_group_gloo = opt.data_parallel_group
    return meta


def save_trainer(trainer, folder: str | Path) -> None:
    """Write ``trainer``'s weights and optimizer state into ``folder`` (an existing empty
    directory on a file system every trainer process sees). Collective: every process of the
    default group calls it (Megatron's ``dist_checkpointing.save`` plans over the whole world)."""
    from megatron.core import dist_checkpointing

    stepped = trainer._stepped()
    sd = _sharded_state_dict(trainer, is_loading=False, with_optimizer=stepped)
    sd[MEGARL_KEY] = {"steps_done": trainer.steps_done, "lr": trainer.lr, "dtype": trainer.cfg.dtype,
                      "distributed_optimizer": trainer.cfg.distributed_optimizer, "optimizer_stepped": stepped,
                      # the model, for `megarl convert torch-dist-to-hf` (megarl/trainer/dist_convert.py)
                      "hf_config": trainer.args.to_hf_config(torch_dtype=trainer.cfg.dtype)}
    dist_checkpointing.save(sd, str(folder), sharded_strategy=(BACKEND, 1))


def read_trainer_meta(folder: str | Path) -> dict[str, Any]:
    """The ``megarl`` part of a trainer folder written by :func:`save_trainer` (any process)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(folder))[MEGARL_KEY]


def load_trainer(trainer, folder: str | Path) -> None:
    """Restore :func:`save_trainer`'s folder into ``trainer``, whatever layout wrote it (same
    model; the optimizer kind must be this trainer's). Collective over the trainer processes."""
    from megatron.core import dist_checkpointing

    meta = read_trainer_meta(folder)
    if bool(meta["distributed_optimizer"]) != trainer.cfg.distributed_optimizer:
        raise ValueError(f"{folder} holds the optimizer state of trainer.distributed_optimizer="
                         f"{meta['distributed_optimizer']}; this run has trainer.distributed_optimizer="
                         f"{trainer.cfg.distributed_optimizer}: resume with trainer.distributed_optimizer="
                         f"{str(bool(meta['distributed_optimizer'])).lower()}")
    stepped = bool(meta["optimizer_stepped"])
    trainer._build_optimizer()  # fresh: the loaded state replaces all of it
    if stepped:
        _allocate_optimizer_state(trainer)
    sd = _sharded_state_dict(trainer, is_loading=True, with_optimizer=stepped)
    loaded = dist_checkpointing.load(sd, str(folder), sharded_strategy=None)
    with torch.no_grad():
        for key, m in zip(_model_keys(trainer), trainer.models):
            m.module.load_state_dict(loaded[key], strict=True)
    if stepped:
        _load_optimizer(trainer, loaded["optimizer"])
    trainer.lr = float(meta["lr"])
    trainer._apply_lr_and_wd()
    trainer.steps_done = int(meta["steps_done"])


def _allocate_optimizer_state(trainer) -> None:
    """Give a fresh distributed optimizer its state tensors (Megatron's sharded state dict of it
    reads them; the plain optimizers allocate theirs in ``sharded_state_dict(is_loading=True)``).
    Megatron's own dummy step writes zero gradients through Adam; every value it touches is then
    overwritten by the load (weights, master weights, moments, step)."""
    if not trainer.cfg.distributed_optimizer:
        return
    for opt in trainer._optimizers():
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def _load_optimizer(trainer, state) -> None:
    """Megatron's ``optimizer.load_state_dict`` of the loaded state, except the distributed
    optimizer's parameter state, loaded here with each ``step`` set aside: without apex/TE torch's
    Adam keeps a ``step`` per parameter, which ``DistributedOptimizer.load_state_dict`` sets from
    the param groups and then, in ``load_parameter_state_from_fully_reshardable``, expects among
    the loaded tensors too (a KeyError). Afterwards each parameter gets its own ``step`` tensor
    (Megatron hands them all one, which torch's Adam would then increment once per parameter)."""
    if not trainer.cfg.distributed_optimizer:
        trainer.optimizer.load_state_dict(state)
        return
    opts = trainer._optimizers()
    states = [state] if len(opts) == 1 else [v for _, v in sorted(state.items())]
    for opt, st in zip(opts, states):
        param_state = st.pop("param_state")
        st.pop("param_state_sharding_type")
        opt.load_state_dict(st)
        steps = {p: s.pop("step") for p, s in opt.optimizer.state.items() if "step" in s}
        opt.load_parameter_state_from_fully_reshardable(param_state)
        for p, step in steps.items():
            opt.optimizer.state[p]["step"] = step.clone() if torch.is_tensor(step) else step
    if len(opts) > 1:
        trainer.optimizer._synchronize_steps()


class TrainerFolder:
    """What an RL checkpoint (megarl/checkpoint/rl_state.py) holds of a trainer in this format:
    the checkpoint writes it with :meth:`write_folder` into its ``trainer/`` folder, every
    process together, and records ``trainer_format`` in ``state.json``."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.distributed_optimizer = trainer.cfg.distributed_optimizer  # (state.json: checked before a resume)

    def write_folder(self, folder: Path) -> None:
        save_trainer(self.trainer, folder)
