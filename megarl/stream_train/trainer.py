"""The policy trainer: Megatron-core GPTModel + DDP + Megatron optimizer, one step per call.

Loss contract (DESIGN.md §2): ``loss_fn`` normalises by the WHOLE step's token (or sample) count,
which the caller puts in the batch. The trainer therefore only sums: gradients of micro-batches
accumulate, data-parallel replicas' gradients are summed (``calculate_per_token_loss`` makes
Megatron's DDP use scaling factor 1), nothing is divided by the number of micro-batches.
"""
from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from megarl.models import mcore_mapping
from megarl.models.config import ModelArgs
from megarl.parallel.dist import ParallelDims
from megarl.stream_train.model import build_gpt_model, gpt_logits, load_hf_state, load_state, parse_dtype

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class TrainerConfig:
    """Optimizer and batching options of the policy trainer."""

    lr: float = 1e-6
    """Learning rate (constant unless ``Trainer.set_lr`` changes it; all params get it)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay; Megatron's convention skips biases and 1-d params."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables clipping)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward pass."""
    dtype: str = "float32"
    """Parameter and compute dtype: ``float32`` or ``float64`` (exactness tests on CPU)."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"TrainerConfig.dtype={self.dtype!r}; valid choices: ['float32', 'float64']")
        if self.micro_batch_size < 1:
            raise ValueError(f"TrainerConfig.micro_batch_size={self.micro_batch_size} must be >= 1")
        if self.lr < 0 or self.weight_decay < 0 or self.clip_grad < 0:
            raise ValueError("TrainerConfig.lr, weight_decay and clip_grad must be >= 0")


def _row_lengths(batch: dict[str, Any]) -> torch.Tensor:
    """Tokens each row needs: through its last trained target (``loss_mask``); without a mask the
    padding is unknown, so the full width."""
    mask = batch.get("loss_mask")
    n, t = batch["input_ids"].shape
    if mask is None:
        return torch.full((n,), t, dtype=torch.long)
    idx = torch.arange(1, mask.shape[1] + 1).expand_as(mask)
    return (idx * (mask != 0)).amax(dim=1) + 1  # last target position + 1, >= 1


def _micro_batches(batch: dict[str, Any], size: int, order: torch.Tensor | None = None):
    """Split per-row entries (tensors whose first dim is the batch size) into slices of ``size``
    rows, taken in ``order`` (rows of similar length together), and trim each slice's time axis
    to its longest row: right padding never costs compute. Everything else (0-d tensors such as
    the step's token count, python values) is passed to every micro-batch unchanged."""
    n, t = batch["input_ids"].shape
    lengths = _row_lengths(batch)
    order = torch.arange(n) if order is None else order
    for start in range(0, n, size):
        rows = order[start:start + size]
        width = int(lengths[rows].max())
        mb = {}
        for k, v in batch.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
                v = v[rows]
                if v.dim() > 1 and v.shape[1] == t:
                    v = v[:, :width]
                elif v.dim() > 1 and v.shape[1] == t - 1:
                    v = v[:, :width - 1]
            mb[k] = v
        yield mb


def _length_order(batch: dict[str, Any]) -> torch.Tensor:
    """Rows sorted by length (stable), so micro-batches hold rows of similar length."""
    return torch.sort(_row_lengths(batch), stable=True).indices


class Trainer:
    """Owns the Megatron model, its DDP wrapper and optimizer on this rank (TP=1, PP=1 for now)."""

    def __init__(self, args: ModelArgs, cfg: TrainerConfig, dims: ParallelDims,
                 hf_state: dict[str, torch.Tensor] | None = None, seed: int = 0):
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        if dims.tp != 1 or dims.pp != 1:
            raise ValueError(f"tensor/pipeline parallel size {dims.tp}/{dims.pp} is not supported yet: the trainer "
                             f"runs with TP=1 and PP=1 (TP/PP training steps are issue 4)")
        self.args, self.cfg, self.dims = args, cfg, dims
        self.dtype = parse_dtype(cfg.dtype)
        if self.dtype == torch.float64 and dims.device.type == "cuda":
            raise ValueError("trainer.dtype=float64 is a CPU mode for exactness tests: Megatron-core's "
                             "gradient clipping accepts only fp32 gradients on CUDA; use float32")
        self.steps_done = 0
        self.lr = cfg.lr  # current learning rate (set_lr changes it, e.g. SFT -> RL)
        model = build_gpt_model(args, dims, self.dtype, seed=seed)
        if hf_state is not None:
            load_hf_state(model, hf_state, args, dims)
        mcfg = model.config
        # Gradients are summed across micro-batches and DP replicas: loss_fn already normalised by
        # the global count. With this flag Megatron's DDP all-reduces with scaling factor 1.
        mcfg.calculate_per_token_loss = True
        # Megatron's schedules all-reduce DP gradients only through this hook (unset: never);
        # train_step calls the same hook, so a later switch to Megatron's schedules (PP) agrees.
        mcfg.finalize_model_grads_func = functools.partial(finalize_model_grads,
                                                           pg_collection=dims.pg_collection)
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=False,  # grads keep the param dtype (fp64 stays fp64)
            overlap_grad_reduce=False,
            use_distributed_optimizer=False,
            check_for_nan_in_grad=True,
        )
        self.model = DistributedDataParallel(mcfg, ddp_cfg, model, pg_collection=dims.pg_collection)
        self._build_optimizer()

    # ------------------------------------------------------------------ internals

    def _build_optimizer(self) -> None:
        """A fresh Megatron optimizer (no moments) over the model's parameters."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.cfg
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=cfg.lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad, params_dtype=self.dtype, bf16=False, fp16=False,
            use_distributed_optimizer=False,
        )
        # Gloo side groups cannot be combined with an explicit pg_collection (Megatron refuses);
        # the non-distributed optimizer does not need them.
        self.optimizer = get_megatron_optimizer(opt_cfg, [self.model], use_gloo_process_groups=False,
                                                pg_collection=self.dims.pg_collection)
        self._apply_lr_and_wd()

    def reset_optimizer(self) -> None:
        """Drop the optimizer's state (Adam moments and step count), keeping the weights: a new
        phase (SFT -> RL) starts from a fresh optimizer, so RL's first updates are RL's alone."""
        self._build_optimizer()

    @property
    def gpt(self):
        """The unwrapped Megatron GPTModel."""
        return self.model.module

    def _apply_lr_and_wd(self) -> None:
        """What Megatron's OptimizerParamScheduler does at a constant lr: per-group lr and weight
        decay from ``lr_mult``/``wd_mult`` (wd_mult is 0 for biases and 1-d params). Without a
        scheduler torch's groups would all carry the base weight decay."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.cfg.weight_decay * group.get("wd_mult", 1.0)

    def _logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logprob [b, T-1] of token t+1 given tokens <= t, in the model dtype (at least fp32).

        Computed from full logits: Megatron's ``vocab_parallel_cross_entropy`` would upcast to
        fp32 only (losing fp64 exactness). TP>1 needs a vocab-parallel version of this over
        ``dims.tp_group``."""
        input_ids = input_ids.to(self.dims.device)
        logits = gpt_logits(self.model, input_ids)[:, :-1]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        targets = input_ids[:, 1:, None]
        return logits.gather(-1, targets)[..., 0] - logits.logsumexp(-1)

    def _all_reduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        if self.dims.dp == 1 or not values:
            return values
        keys = sorted(values)
        buf = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(buf, group=self.dims.dp_group)
        return dict(zip(keys, buf.tolist()))

    # ------------------------------------------------------------------ public API

    def token_logprobs(self, input_ids: torch.Tensor, no_grad: bool = True) -> torch.Tensor:
        """Logprob [B, T-1] (model dtype, on CPU) of ``input_ids[:, t+1]`` given ``input_ids[:, :t+1]``,
        in micro-batches of ``micro_batch_size`` rows. Right padding is harmless (causal)."""
        ctx = torch.no_grad() if no_grad else torch.enable_grad()
        with ctx:
            return torch.cat([self._logprobs(mb["input_ids"]).cpu()
                              for mb in _micro_batches({"input_ids": input_ids}, self.cfg.micro_batch_size)])

    def masked_logprobs(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """Like :meth:`token_logprobs` (no grad) but only where ``loss_mask`` is set (0 elsewhere):
        rows are length-sorted and trimmed, so padding costs nothing."""
        batch = {"input_ids": input_ids, "loss_mask": loss_mask}
        order = _length_order(batch)
        out = torch.zeros(loss_mask.shape, dtype=torch.promote_types(self.dtype, torch.float32))
        with torch.no_grad():
            start = 0
            for mb in _micro_batches(batch, self.cfg.micro_batch_size, order):
                rows = order[start:start + mb["input_ids"].shape[0]]
                start += len(rows)
                lp = self._logprobs(mb["input_ids"]).cpu()
                out[rows, :lp.shape[1]] = lp * (mb["loss_mask"] != 0)
        return out

    def train_step(self, batch: dict[str, Any], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over ``batch`` (``input_ids`` [B, T] right-padded, ``loss_mask``
        [B, T-1], plus whatever ``loss_fn`` reads). ``loss_fn(logprobs [b, T-1], micro_batch)``
        returns ``(loss, metrics)`` with the loss already normalised by the whole step's count.

        Returns the summed ``loss``, the summed ``loss_fn`` metrics (summed over DP too), the
        pre-clip ``grad_norm`` and ``update_ok`` (False if the optimizer skipped the step)."""
        if "input_ids" not in batch or "loss_mask" not in batch:
            raise KeyError(f"train_step batch needs input_ids and loss_mask; got {sorted(batch)}")
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_sum, metrics = 0.0, {}
        for mb in _micro_batches(batch, self.cfg.micro_batch_size, _length_order(batch)):
            mb = {k: v.to(self.dims.device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
            loss, mb_metrics = loss_fn(self._logprobs(mb["input_ids"]), mb)
            loss.backward()
            loss_sum += float(loss.detach())
            for k, v in mb_metrics.items():
                metrics[k] = metrics.get(k, 0.0) + float(v)
        # DP all-reduce of the accumulated grads (+ later: embedding/TP-norm grad reductions).
        self.gpt.config.finalize_model_grads_func([self.model])
        update_ok, grad_norm, _ = self.optimizer.step()
        self.steps_done += 1
        out = self._all_reduce_sum({"loss": loss_sum, **metrics})
        out["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        out["update_ok"] = float(bool(update_ok))
        return out

    def set_lr(self, lr: float) -> None:
        """Use learning rate ``lr`` from the next step on (kept in checkpoints)."""
        if lr < 0:
            raise ValueError(f"lr={lr} must be >= 0")
        self.lr = float(lr)
        self._apply_lr_and_wd()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the weights under HF names, in the model dtype, on CPU (export, checkpoints and
        the single-process weight sync; bucketed device-to-device sync is issue 4's)."""
        sd = {k: v.detach().to("cpu", copy=True) for k, v in self.gpt.state_dict().items()
              if not k.endswith("_extra_state")}
        return mcore_mapping.mcore_to_hf(sd, self.args)

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint: Megatron-named model weights, Megatron optimizer state, lr, steps done. Deep
        copies, so later steps do not alter a checkpoint kept in memory."""
        return {
            "model": {k: v.detach().clone() for k, v in self.gpt.state_dict().items()
                      if not k.endswith("_extra_state")},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "steps_done": self.steps_done,
            "lr": self.lr,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the next ``train_step`` continues the saved run bitwise."""
        load_state(self.gpt, sd["model"])
        self.optimizer.load_state_dict(copy.deepcopy(sd["optimizer"]))
        self.lr = float(sd.get("lr", self.cfg.lr))  # the lr in effect when saved
        self._apply_lr_and_wd()  # weight decay: this run's config
        self.steps_done = int(sd["steps_done"])
