"""The policy trainer: Megatron-core GPTModel + DDP + Megatron optimizer, one step per call.

Loss contract (docs/design.md §1): ``loss_fn`` normalises by the WHOLE step's token (or sample) count,
which the caller puts in the batch. The trainer therefore only sums: gradients of micro-batches
accumulate, data-parallel replicas' gradients are summed (``calculate_per_token_loss`` makes
Megatron's DDP use scaling factor 1), nothing is divided by the number of micro-batches.

Metrics: ``loss_fn``'s metrics are summed over micro-batches and data-parallel ranks (they are
sums normalised by the step's count too), except those named ``*_max``, which are maxima
(megarl/trainer/step_metrics.py).

Temperature: the logprobs handed to ``loss_fn`` and returned by :meth:`Trainer.masked_logprobs`
are ``log softmax(logits / temperature)`` (``temperature`` argument, default 1; 0 reads as 1), the
distribution the engine samples from (megarl/trainer/logprobs.py). It is an argument of each
call, not trainer state: one trainer runs SFT (T=1) and RL (the rollout's T).

Layout (megarl/trainer/micro_batches.py): a micro-batch's rows run packed into one sequence
without padding (Megatron's THD format; each row attends to itself only), and only the positions
whose logprob is needed (the loss mask's) go through the output layer and the log-softmax over the
vocabulary. With virtual pipeline stages, whose schedule needs one shape for every micro-batch, the
rows are right padded to the batch's longest instead. Both give the same logprobs up to rounding.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from megarl.models.config import ModelArgs
from megarl.checkpoint.convert import read_hf_piece
from megarl.models.init_weights import init_hf_state
from megarl.parallel.collectives import group_device
from megarl.parallel.dist import ParallelDims, trainer_world
from megarl.trainer import step_metrics
from megarl.trainer.logprobs import vocab_parallel_logprobs
from megarl.trainer.micro_batches import ModelInput, length_order, micro_batches, model_input, pad_rows
from megarl.trainer.model import build_gpt_model, load_hf_state, load_state, parse_dtype
from megarl.trainer.sequence_parallel import length_multiple
from megarl.trainer.trainer_state import TrainerState

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
    """Sequences per forward/backward pass (unless ``micro_batch_tokens`` is set)."""
    micro_batch_tokens: int = 0
    """When > 0: micro-batches are cut by tokens instead of rows: consecutive rows (in length
    order) packed up to this many tokens, a longer row alone. Not with virtual pipeline stages
    (their micro-batches are ``micro_batch_size`` rows of one shape). 0: ``micro_batch_size`` rows."""
    dtype: str = "float32"
    """Parameter and compute dtype: ``float32``, ``bfloat16`` (mixed precision: bf16 weights and
    matmuls, fp32 master weights, gradients and Adam state, gradients reduced in fp32, logprobs
    and the loss in fp32) or ``float64`` (exactness tests on CPU)."""
    recompute: str = "none"
    """Activation recompute (Megatron's recompute_granularity): ``none`` keeps every activation
    for the backward; ``selective`` recomputes each layer's core attention and MLP in the
    backward; ``full`` recomputes each whole layer from its input (least memory, one more forward
    of the layers). The same gradients, up to rounding."""
    attention: str = "sdpa"
    """The core attention's math: ``sdpa`` (torch's fused scaled-dot-product attention, memory
    linear in the sequence length) or ``eager`` (the CPU engine's own math, HF's eager attention:
    in bf16 the trainer's logprobs then equal the engine's bit for bit, so ``logprob_diff_max`` is
    0 instead of two independent bf16 roundings, docs/design.md §1.3; memory quadratic in the
    sequence length, not in ``megarl plan``'s estimate). fp32 and fp64 runs gain nothing from it."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer (ZeRO-1): the master weights and Adam moments are sharded
    over the data-parallel ranks (each holds 1/DP of them), gradients are reduce-scattered and
    the updated weights all-gathered. Same update as without it, up to rounding."""

    checkpoint_format: str = "pieces"
    """How RL checkpoints hold the trainer: ``pieces`` (one file per model-parallel piece; resumes
    in the layout that wrote it) or ``torch_dist`` (a Megatron-core distributed checkpoint,
    megarl/trainer/dist_ckpt.py: resumes on another TP/PP/DP layout, and Megatron-LM reads
    it; not with virtual pipeline stages or disaggregated placement)."""

    def __post_init__(self) -> None:
        from megarl.utils.dataclass_config import check_number
        if self.checkpoint_format not in ("pieces", "torch_dist"):
            raise ValueError(f"trainer.checkpoint_format={self.checkpoint_format!r} is invalid; valid choices: "
                             f"['pieces', 'torch_dist']")
        if self.dtype not in ("float32", "bfloat16", "float64"):
            raise ValueError(f"trainer.dtype={self.dtype!r} is invalid; valid choices: "
                             f"['float32', 'bfloat16', 'float64']")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"trainer.recompute={self.recompute!r} is invalid; valid choices: "
                             f"['none', 'selective', 'full']")
        if self.attention not in ("sdpa", "eager"):
            raise ValueError(f"trainer.attention={self.attention!r} is invalid; valid choices: ['sdpa', 'eager']")
        if self.distributed_optimizer and self.dtype == "float64":
            raise ValueError("trainer.distributed_optimizer=true needs trainer.dtype float32 or bfloat16 (Megatron's "
                             "distributed optimizer takes no fp64 parameters); got trainer.dtype=float64")
        check_number("trainer.micro_batch_size", self.micro_batch_size, ge=1, integer=True)
        check_number("trainer.micro_batch_tokens", self.micro_batch_tokens, ge=0, integer=True,
                     note="0 = micro-batches of micro_batch_size rows")
        for name in ("lr", "weight_decay", "clip_grad", "adam_beta1", "adam_beta2"):  # (clip_grad 0: no clipping)
            check_number(f"trainer.{name}", getattr(self, name), ge=0, lt=1 if name.startswith("adam") else None)
        check_number("trainer.adam_eps", self.adam_eps, gt=0)


def _finalize_grads(finalize, model, num_tokens=None, **kwargs) -> None:
    """Megatron's ``finalize_model_grads`` (DP all-reduce, tied-embedding all-reduce across the
    first and last stage) without its division by the schedule's token count: ``loss_fn`` already
    divided by the step's global count (module docstring)."""
    finalize(model, None, **kwargs)


class Trainer(TrainerState):
    """Owns this rank's piece of the Megatron model (its TP rank and PP stage), its DDP wrapper and
    optimizer."""

    def __init__(self, args: ModelArgs, cfg: TrainerConfig, dims: ParallelDims,
                 hf_state: dict[str, torch.Tensor] | None = None, seed: int = 0, hf_dir: str | None = None,
                 mcore_dir: str | None = None):
        """Starting weights: ``hf_dir`` (a HF folder: this rank reads only its own piece, see
        :func:`megarl.checkpoint.convert.read_hf_piece`), or ``mcore_dir`` (``megarl convert hf-to-mcore``'s
        folder of this layout, or a torch_dist folder of any: ``TrainerState._load_mcore_start``), else
        ``hf_state`` (full HF-named tensors), else fresh ones drawn from ``seed``
        (:func:`megarl.models.init_weights.init_hf_state`), the same for every layout."""
        if sum(x is not None for x in (hf_dir, mcore_dir, hf_state)) > 1:
            raise ValueError("Trainer takes one of hf_dir, mcore_dir and hf_state")
        from megatron.core.distributed import DistributedDataParallelConfig
        self.args, self.cfg, self.dims = args, cfg, dims
        self.dtype = parse_dtype(cfg.dtype)
        self.mixed_precision = self.dtype == torch.bfloat16
        if self.dtype == torch.float64 and dims.device.type == "cuda":
            raise ValueError("trainer.dtype=float64 is a CPU mode for exactness tests: Megatron-core's "
                             "gradient clipping accepts only fp32 gradients on CUDA; use float32")
        self.steps_done = 0
        self.lr = cfg.lr  # current learning rate (set_lr changes it, e.g. SFT -> RL)
        # Rows packed without padding (THD); virtual pipeline stages need one shape for every
        # micro-batch, so they take right-padded rows. False: padded rows (benchmarks compare).
        self.pack = dims.vpp == 1
        self._selection: torch.Tensor | None = None  # positions the output layer scores (_select_hidden)
        if mcore_dir is not None:
            self._check_mcore_layout(mcore_dir)
        elif hf_dir is None and hf_state is None:
            # A fresh model is drawn whole and sharded (models/init_weights.py): Megatron's own init
            # would depend on the TP/PP/EP layout, and a run must start where its single-process
            # equivalent starts.
            hf_state = init_hf_state(args, seed, self.dtype)
        ddp_cfg = DistributedDataParallelConfig(
            # bf16: gradients accumulate and are all-reduced in fp32 (the main_grad buffers the
            # mixed-precision optimizer reads); fp32 and fp64 keep the param dtype.
            grad_reduce_in_fp32=self.mixed_precision,
            overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.distributed_optimizer,
            check_for_nan_in_grad=True,
        )
        self.models = [self._wrapped_chunk(chunk, ddp_cfg, seed, hf_dir, mcore_dir, hf_state)
                       for chunk in range(dims.vpp)]
        self._build_optimizer()

    def _wrapped_chunk(self, chunk: int, ddp_cfg, seed: int, hf_dir: str | None, mcore_dir: str | None,
                       hf_state: dict[str, torch.Tensor] | None):
        """Model chunk ``chunk`` (a virtual pipeline stage of this rank; the only one without vpp)
        with its starting weights, wrapped in its own DDP as Megatron's get_model does (bucketing
        only for the first chunk)."""
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        args, dims, cfg = self.args, self.dims, self.cfg
        model = build_gpt_model(args, dims, self.dtype, seed=seed, chunk=chunk, recompute=cfg.recompute,
                                attention=cfg.attention)
        if hf_dir is not None:
            load_state(model, read_hf_piece(hf_dir, args, dims.tp, dims.stages, dims.tp_rank, dims.stage(chunk),
                                            ep=dims.ep, ep_rank=dims.ep_rank))
        elif mcore_dir is not None:  # converted pieces of this layout, or a torch_dist folder (any)
            self._load_mcore_start(model, mcore_dir, chunk)
        else:
            load_hf_state(model, hf_state, args, dims, chunk=chunk)
        mcfg = model.config
        # Gradients are summed across micro-batches and DP replicas: loss_fn already normalised
        # by the global count. With this flag Megatron's DDP all-reduces with scaling factor 1.
        mcfg.calculate_per_token_loss = True
        # Megatron's schedules all-reduce DP gradients (and the tied embedding's grads across
        # the first and last pipeline stage) only through this hook; unset, they never would be.
        mcfg.finalize_model_grads_func = functools.partial(_finalize_grads, finalize_model_grads)
        # Micro-batches are trimmed to their longest row, so pipeline stages exchange shapes
        # (not with virtual stages: see _split).
        mcfg.variable_seq_lengths = dims.pp > 1 and dims.vpp == 1
        wrapped = DistributedDataParallel(mcfg, ddp_cfg, model, disable_bucketing=chunk > 0,
                                          pg_collection=dims.pg_collection)
        if model.post_process:
            model.output_layer.register_forward_pre_hook(self._select_hidden)
        return wrapped

    def _select_hidden(self, module, args):
        """Forward pre-hook of the output layer: during the trainer's forwards, only the hidden
        states [s, b, h] at the positions ``self._selection`` (flattened [s, b] index) are turned
        into logits, as [k, 1, h]; the model then returns logits [1, k, vocab/tp]. Other callers
        (``_selection`` None) get every position."""
        if self._selection is None:
            return None
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, self._selection)[:, None], *args[1:])

    # ------------------------------------------------------------------ internals

    def _build_optimizer(self) -> None:
        """A fresh Megatron optimizer (no moments) over the model's parameters."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.cfg
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=cfg.lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad, params_dtype=self.dtype, fp16=False,
            # bf16: Megatron's mixed-precision optimizer, fp32 master copies of the bf16 weights
            # (main_params_dtype) and fp32 gradients and moments; no loss scaling in bf16.
            bf16=self.mixed_precision, main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
            use_distributed_optimizer=cfg.distributed_optimizer,
        )
        # Gloo side groups cannot be combined with an explicit pg_collection (Megatron refuses);
        # the optimizers do not need them here (the distributed one's checkpoints are per-rank
        # shards, trainer_state.py, not Megatron's gloo gather to DP rank 0).
        with trainer_world(self.dims):  # it aligns parameter groups over the "world": the trainers
            self.optimizer = get_megatron_optimizer(opt_cfg, self.models, use_gloo_process_groups=False,
                                                    pg_collection=self.dims.pg_collection)
        self._apply_lr_and_wd()

    def reset_optimizer(self) -> None:
        """Drop the optimizer's state (Adam moments and step count), keeping the weights: a new
        phase (SFT -> RL) starts from a fresh optimizer, so RL's first updates are RL's alone.
        In bf16 the weights kept are the fp32 master weights (a fresh optimizer would copy them
        from the bf16 weights, dropping what bf16 rounds off)."""
        masters = self.master_weights()
        self._build_optimizer()
        self.restore_master_weights(masters)

    @property
    def model(self):
        """The DDP-wrapped model (the first chunk with virtual pipeline stages: see ``models``)."""
        return self.models[0]

    @property
    def gpt(self):
        """The unwrapped Megatron GPTModel (the first chunk with virtual pipeline stages)."""
        return self.models[0].module

    def _apply_lr_and_wd(self) -> None:
        """What Megatron's OptimizerParamScheduler does at a constant lr: per-group lr and weight
        decay from ``lr_mult``/``wd_mult`` (wd_mult is 0 for biases and 1-d params). Without a
        scheduler torch's groups would all carry the base weight decay."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.cfg.weight_decay * group.get("wd_mult", 1.0)

    def _split(self, batch: dict[str, Any], order: torch.Tensor | None) -> tuple[list[dict[str, Any]], torch.Tensor]:
        """``batch``'s micro-batches (rows taken in ``order``) and the row order they hold.

        The interleaved schedule (``vpp`` > 1) needs at least ``pp`` micro-batches, all of one
        shape: smaller ones are cut then, the batch gets zero-mask padding rows (indices >= its
        row count in the returned order) up to a whole number of them, and all have the batch's
        longest width. (Variable shapes need a shape exchange before each p2p, which in the
        interleaved schedule can wait on a peer that is itself waiting for this rank's tensors:
        with pp=2 a rank's forward-only exchange meets its peer's forward-and-backward one.)"""
        n = batch["input_ids"].shape[0]
        order = torch.arange(n) if order is None else order
        size = self.cfg.micro_batch_size
        if self.dims.vpp == 1:
            mbs = list(micro_batches(batch, size, order, max_tokens=self.cfg.micro_batch_tokens))
        else:
            pp = self.dims.pp
            size = max(1, min(size, max(n, pp) // pp))  # then ceil(rows / size) >= pp
            rows = max(pp, -(-n // size)) * size
            if rows > n:
                batch = pad_rows(batch, rows - n)
                order = torch.cat([order, torch.arange(n, rows)])
            mbs = list(micro_batches(batch, size, order, trim=False))
        pack = self.pack and self.dims.vpp == 1
        multiple = length_multiple(self.dims)  # sequence parallelism splits the sequence over TP
        return [{**mb, "model_input": model_input(mb, pack, multiple)} for mb in mbs], order

    def _forward_backward(self, microbatches: list[dict[str, Any]], loss_fn: LossFn | None,
                          temperature: float = 1.0) -> list[dict]:
        """Megatron's schedule over ``microbatches`` (1F1B through the pipeline stages with PP > 1,
        interleaved over the model chunks with virtual stages, a plain loop otherwise). With ``loss_fn``: forward and backward, gradients accumulate and
        are finalized (DP all-reduce, tied-embedding all-reduce). Without: forward only.

        Returns, on the last pipeline stage, one dict per micro-batch: ``logprobs`` (forward only)
        or ``loss`` and the ``loss_fn`` metrics; on other stages an empty list."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        dims, vocab, device = self.dims, self.args.vocab_size, self.dims.device
        # Megatron adds these per-micro-batch counts into a token total and, with
        # calculate_per_token_loss, hands it to finalize_model_grads, which _finalize_grads drops.
        one = torch.ones((), dtype=torch.int, device=device)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            inp: ModelInput = mb["model_input"]
            self._selection = inp.select  # the output layer scores these positions only
            try:
                # no attention mask: the core attention is causal by position (model.py)
                out = model(inp.input_ids, inp.position_ids, None, packed_seq_params=inp.packed_seq_params())
            finally:
                self._selection = None

            def loss_func(local_logits: torch.Tensor):
                # local_logits [1, k, vocab/tp]: the selected positions' logits
                lp = vocab_parallel_logprobs(local_logits[0], inp.targets, dims.tp_group, vocab, temperature)
                lp = inp.scatter(lp, mb["input_ids"].shape[1])  # [rows, width - 1], 0 where not scored
                if loss_fn is None:
                    return lp.new_zeros(()), one, {"logprobs": lp.detach()}
                loss, metrics = loss_fn(lp, mb)
                return loss, one, {"loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}}

            return out, loss_func

        microbatches = [{k: v.to(device) if isinstance(v, (torch.Tensor, ModelInput)) else v for k, v in mb.items()}
                        for mb in microbatches]
        extra = {}
        if dims.pp > 1:
            extra["p2p_communicator"] = P2PCommunicator(pp_group=dims.pp_group, config=self.gpt.config)
        data = iter(microbatches)
        if dims.vpp > 1:
            data = [iter(microbatches) for _ in self.models]  # each chunk reads every micro-batch
            # Micro-batches run through a chunk in groups of pp (Megatron's default); the group
            # size must lie in [pp, M] and leave no remainder in (0, pp): one group of all M
            # otherwise (_split guarantees M >= pp).
            m = len(microbatches)
            self.gpt.config.microbatch_group_size_per_vp_stage = dims.pp if m % dims.pp == 0 else m
        shapes = [mb["model_input"].input_ids.shape for mb in microbatches]  # [b, s] as the model sees them
        return get_forward_backward_func(pp_size=dims.pp, vp_size=dims.vpp if dims.vpp > 1 else None)(
            forward_step_func=forward_step, data_iterator=data, model=self.models,
            num_microbatches=len(microbatches),
            # equal for all with virtual stages (_split); unused with variable lengths
            seq_length=max(s[1] for s in shapes), micro_batch_size=max(s[0] for s in shapes),
            forward_only=loss_fn is None, pg_collection=dims.pg_collection, **extra)

    @property
    def _last_stage(self) -> bool:
        return self.dims.pp_rank == self.dims.pp - 1

    def _broadcast_from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        """The last pipeline stage's ``t`` on every stage (others pass a buffer of the same shape)."""
        if self.dims.pp > 1:
            t = t.to(group_device(self.dims.pp_group))
            dist.broadcast(t, group=self.dims.pp_group, group_src=self.dims.pp - 1)
        return t.cpu()

    def _masked_logprobs_impl(self, batch: dict[str, Any], order: torch.Tensor | None,
                              temperature: float) -> torch.Tensor:
        input_ids = batch["input_ids"]
        out = torch.zeros((input_ids.shape[0], input_ids.shape[1] - 1),
                          dtype=torch.promote_types(self.dtype, torch.float32))
        mbs, order = self._split(batch, order)
        with torch.no_grad():
            outputs = self._forward_backward(mbs, None, temperature)
        if self._last_stage:
            start = 0
            for mb, res in zip(mbs, outputs):
                rows = order[start:start + mb["input_ids"].shape[0]]
                start += len(rows)
                lp = res["logprobs"].cpu()
                if "loss_mask" in mb:
                    lp = lp * (mb["loss_mask"] != 0)
                real = rows < input_ids.shape[0]  # not _split's padding
                out[rows[real], :lp.shape[1]] = lp[real]
        return self._broadcast_from_last_stage(out)

    # ------------------------------------------------------------------ public API

    def token_logprobs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
        """Logprob [B, T-1] (no grad; at least fp32, on CPU, on every rank) of ``input_ids[:, t+1]``
        given ``input_ids[:, :t+1]`` under ``softmax(logits / temperature)`` (0 reads as 1), in
        micro-batches of ``micro_batch_size`` rows. Right padding is harmless (causal)."""
        return self._masked_logprobs_impl({"input_ids": input_ids}, None, temperature)

    def masked_logprobs(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, *,
                        temperature: float = 1.0) -> torch.Tensor:
        """Like :meth:`token_logprobs` but only where ``loss_mask`` is set (0 elsewhere): rows are
        length-sorted and trimmed, so padding costs nothing."""
        batch = {"input_ids": input_ids, "loss_mask": loss_mask}
        return self._masked_logprobs_impl(batch, length_order(batch), temperature)

    def train_step(self, batch: dict[str, Any], loss_fn: LossFn, *, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step over ``batch`` (``input_ids`` [B, T] right-padded, ``loss_mask``
        [B, T-1], plus whatever ``loss_fn`` reads). ``loss_fn(logprobs [b, T-1], micro_batch)``
        returns ``(loss, metrics)`` with the loss already normalised by the whole step's count; the
        logprobs are at ``temperature`` (RL: the rollout's, so they are the sampler's; SFT: 1).
        Every rank of a data-parallel replica (its TP and PP ranks) passes the same ``batch``;
        ``loss_fn`` runs on the last pipeline stage.

        Returns, on every rank, the summed ``loss``, the summed ``loss_fn`` metrics (summed over DP
        too; ``*_max`` ones maximised), the pre-clip ``grad_norm`` and ``update_ok`` (False if the
        optimizer skipped the step)."""
        self.begin_step()
        self.accumulate(batch, loss_fn, temperature=temperature)
        return self.finish_step()

    def begin_step(self) -> None:
        """Start accumulating the gradients of one optimizer step (see :meth:`accumulate`)."""
        for m in self.models:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._sums: dict[str, float] = {}

    def accumulate(self, batch: dict[str, Any], loss_fn: LossFn, *, temperature: float = 1.0) -> None:
        """Forward and backward of ``batch`` (as in :meth:`train_step`), gradients added to the
        step's; nothing is reduced across ranks yet. Stream training calls it once per finished
        group while rollout goes on (megarl/stream_train/stream.py)."""
        if "input_ids" not in batch or "loss_mask" not in batch:
            raise KeyError(f"train_step batch needs input_ids and loss_mask; got {sorted(batch)}")
        mbs, _ = self._split(batch, length_order(batch))
        config = self.gpt.config
        finalize, config.finalize_model_grads_func = config.finalize_model_grads_func, None
        try:  # the schedule would finalize (all-reduce) after every call: finish_step does it once
            outputs = self._forward_backward(mbs, loss_fn, temperature)
        finally:
            config.finalize_model_grads_func = finalize
        for res in outputs:
            step_metrics.merge(self._sums, res)

    def finish_step(self, scale: float = 1.0) -> dict[str, float]:
        """Reduce the accumulated gradients (DP all-reduce, tied embeddings), multiply them and the
        summed ``loss_fn`` metrics by ``scale``, take the optimizer step. ``scale`` is 1 when
        ``loss_fn`` already divided by the step's count; stream training passes 1/count, the
        count being known only once the step's last group is in (docs/design.md §1)."""
        self.gpt.config.finalize_model_grads_func(self.models)
        if scale != 1.0:
            for m in self.models:
                m.scale_gradients(scale)
        update_ok, grad_norm, _ = self.optimizer.step()
        self.steps_done += 1
        sums = self._sums
        if self.dims.pp > 1:  # only the last stage ran loss_fn
            box = [sums]
            dist.broadcast_object_list(box, group=self.dims.pp_group, group_src=self.dims.pp - 1,
                                       device=group_device(self.dims.pp_group))
            sums = box[0]
        out = step_metrics.scaled(step_metrics.all_reduce(sums, self.dims), scale)
        out["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        out["update_ok"] = float(bool(update_ok))
        return out

    def set_lr(self, lr: float) -> None:
        """Use learning rate ``lr`` from the next step on (kept in checkpoints)."""
        if lr < 0:
            raise ValueError(f"lr={lr} must be >= 0")
        self.lr = float(lr)
        self._apply_lr_and_wd()
