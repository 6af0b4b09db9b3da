"""The synchronous GRPO run: set-up, SFT warm-up, the step loop, checkpoints, the final export.

Each step is ``megarl.stages.step.run_step``; this module builds what it runs on (trainer,
engines, rollout stages, bubble policy, weight sync: megarl/stages/roles.py) from the run config,
and is, with the set-up (megarl/setup_run.py), the only place that reads the whole config.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from megarl.checkpoint.export import export_hf
from megarl.checkpoint.rl_state import remove_orphaned_temporaries, save_checkpoint
from megarl.config import RunConfig, dump_config
from megarl.engine import Engine
from megarl.engine.tp_model import TPCausalLM
from megarl.engine.vllm_backend import VLLMEngine
from megarl.engine.vllm_groups import VLLMGroups
from megarl.engine.vllm_spec import speculative_config
from megarl.models.llama import CausalLM
from megarl.parallel.dist import init_distributed, shutdown_distributed
from megarl.parallel.launch_env import export_launch_env
from megarl.parallel.layout import Layout, RolloutGroups, check_trainer_groups, create_rollout_groups
from megarl.parallel.preempt import RECORD_NAME, PreemptSignals
from megarl.parallel.watchdog import RankWatchdog
from megarl.parallel.weight_sync import WeightSync
from megarl.rl.grpo import UpdateSpec
from megarl.rl.rollout_correction import describe as describe_correction
from megarl.resume import check_checkpoint_fits, check_run_dir, record, restore
from megarl.rollout.backend import RolloutBackend
from megarl.rollout.scoring import rollout_line
from megarl.rollout.stage import RolloutStage
from megarl.run_dir import clear_start, restart_line, start_leftovers
from megarl.sched.policy import BubblePolicy
from megarl.sched.prompts import PromptSchedule
from megarl.sched.timeline import timeline_line
from megarl.setup_run import RunInputs, check_layout, prepare_inputs
from megarl.spec.drafter_state import drafter_files, restore_drafter
from megarl.spec.speculator import Speculator
from megarl.stages.evaluate import Evaluation
from megarl.stages.roles import Exchange, NoRollout, NoTrainer, RolloutSide, TrainerSide
from megarl.stages.sft import run_sft
from megarl.stages.step import RoundSync, Run, StepResult, run_step
from megarl.trainer.model import parse_dtype
from megarl.trainer.reference import ShardedReference
from megarl.trainer.trainer import Trainer
from megarl.utils.dataclass_config import to_dict
from megarl.utils.fs import atomic_write_text
from megarl.utils.jsonl import append_line
from megarl.utils.metrics_log import MetricsLogger
from megarl.utils.run_lock import RunLock, lock_run_dir

log = logging.getLogger("megarl")
# Metrics that measure time: everything else in metrics.jsonl is a deterministic function of the
# config (a resumed run reproduces it exactly).
TIME_KEYS = ("rollout_time_s", "train_time_s", "step_time_s", "weight_sync_s", "weight_sync_gbps", "vllm_load_s",
             "bubble_time_s", "stream_train_time_s", "bubble_frac", "bubble_tokens", "bubble_groups",
             "reward_timeout_s", "drafter_train_steps", "drafter_loss", "eval_time_s")


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False, inputs: RunInputs | None = None,
          lock: RunLock | None = None) -> list[dict]:
    """Run ``cfg`` in ``run_dir``; returns the metrics of the steps run by this call. ``lock``:
    the run directory's lock if the caller took it already (the CLI does, first thing); else rank
    0 takes it here, before anything is written. Held until this returns."""
    run_dir = Path(run_dir)
    export_launch_env()  # srun/MPI ranks as torchrun's RANK/WORLD_SIZE, before anything reads them
    inputs = inputs or prepare_inputs(cfg)  # all bad input fails here, before anything is written
    rank0 = int(os.environ.get("RANK", "0")) == 0  # the process that writes run-level files
    lock = lock or lock_run_dir(run_dir)  # (rank 0; None elsewhere)
    try:
        if lock is not None:  # the only writer: what an interrupted write left behind is garbage
            remove_orphaned_temporaries(run_dir, lock)
        return _locked_train(cfg, run_dir, resume, inputs, rank0)
    finally:
        if lock is not None:
            lock.release()


def _locked_train(cfg: RunConfig, run_dir: Path, resume: bool, inputs: RunInputs, rank0: bool) -> list[dict]:
    ckpt = check_run_dir(run_dir, resume)
    if ckpt is not None:  # (the CLI checked it already; a caller of train() may not have)
        check_checkpoint_fits(ckpt, cfg)
    if rank0:
        if ckpt is None and start_leftovers(run_dir):
            log.warning(restart_line(run_dir, clear_start(run_dir), resume))
        elif ckpt is None:
            log.info("starting a new run in %s", run_dir)
        atomic_write_text(run_dir / "config.yaml", dump_config(cfg))
    if cfg.deterministic:
        set_deterministic()
    p = cfg.parallel
    trainers = None  # disaggregated: the first world - rollout_ranks processes train (Megatron's world)
    if p.placement == "disaggregated":
        trainers = int(os.environ.get("WORLD_SIZE", "1")) - p.rollout_ranks
    dims = init_distributed(tp=p.trainer_tp, pp=p.trainer_pp, ep=p.trainer_ep, vpp=p.trainer_vpp,
                            trainer_ranks=trainers, sequence_parallel=p.sequence_parallel)
    try:
        # Inside the try: the watchdog stops (a store barrier) before the process group goes, and
        # before PreemptSignals raises Preempted (exit 75) after a signal's checkpoint.
        preempt = PreemptSignals(device=dims.device, record=run_dir / RECORD_NAME if rank0 else None)
        with preempt, RankWatchdog(cfg.watchdog):
            layout = inputs.layout or check_layout(cfg, inputs.args, dims.world_size)
            if dims.trains:
                check_trainer_groups(layout, dims.tp_group, dims.pp_group, dims.dp_group)
            if dims.rank == 0:
                log.info("process layout: %s", layout.describe())
                log.info(describe_correction(cfg.grpo.rollout_correction, cfg.grpo.rollout_correction_threshold))
            return _train(cfg, run_dir, inputs, ckpt, dims, create_rollout_groups(layout), layout, preempt)
    finally:
        shutdown_distributed(dims)


def _train(cfg: RunConfig, run_dir: Path, inputs: RunInputs, ckpt: Path | None, dims, rollout_groups: RolloutGroups,
           layout: Layout, preempt: PreemptSignals | None = None) -> list[dict]:
    run, start, engine, close_rollout = _build(cfg, run_dir, inputs, ckpt, dims, rollout_groups, layout)
    evaluation = Evaluation.build(cfg.eval, cfg.rl_steps, inputs, engine, cfg.rollout, cfg.reward, rollout_groups,
                                  layout.rollout_dp, run.exchange.from_generators, dims.rank == 0)
    history = []
    bar = tqdm(range(start, cfg.rl_steps), desc="GRPO", disable=not cfg.progress or dims.rank != 0, initial=start,
               total=cfg.rl_steps)
    with MetricsLogger(run_dir, cfg.logging, enabled=dims.rank == 0, config_dict=to_dict(cfg),
                       resume_step=start) as metrics_log:
        if start == 0 and (before := evaluation(0)) and dims.rank == 0:
            metrics_log.log(0, before)  # the weights RL starts from (a line of its own: step 0)
        for step in bar:
            result = run_step(run, step)
            result.metrics.update(evaluation(step + 1))  # the weights the step's sync put in the engine
            history.append(result.metrics)
            if dims.rank == 0:
                _write_step(run_dir, cfg, result, run.rollout.aborted, metrics_log)
                bar.set_postfix(reward=f"{result.metrics['reward_mean']:.3f}",
                                len=f"{result.metrics['response_len_mean']:.0f}")
            stop = preempt is not None and preempt.agree()  # a signal on any rank: all stop after this step
            if stop or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0):
                _checkpoint(run_dir, cfg, dims, run, step + 1, engine, rollout_groups.group_index,
                            record(cfg, inputs.data_sha256))
            if stop:
                preempt.stop(step + 1)
                break
    run.rollout.close()
    if preempt is not None and preempt.stopped_at is not None:
        return history  # unfinished: no export (leaving PreemptSignals raises Preempted)
    _export(run_dir, inputs, dims, run, engine, layout)
    close_rollout()  # before megarl's process groups go: vLLM tears down its own
    return history


def _build(cfg: RunConfig, run_dir: Path, inputs: RunInputs, ckpt: Path | None, dims, rollout_groups: RolloutGroups,
           layout: Layout) -> tuple[Run, int, RolloutBackend | None, Callable[[], None]]:
    """The step's objects for this process's role, the step to start from (a checkpoint's, after
    SFT when starting afresh), this process's engine (None if it does not generate) and what
    closes the rollout side at the end (the engine; on a trainer-only process of a vLLM run, its
    share of vLLM's process groups)."""
    trainer = engine = None
    close_rollout: Callable[[], None] = lambda: None
    if dims.trains:
        trainer = Trainer(inputs.args, cfg.trainer, dims, hf_dir=inputs.init_from_hf,
                          mcore_dir=inputs.init_from_mcore, seed=cfg.seed)
    if dims.generates:
        engine = _make_engine(cfg, inputs, layout.cfg.rollout_tp, rollout_groups.tp_group)
        close_rollout = engine.close
    elif cfg.rollout.backend == "vllm":  # a trainer-only process joins vLLM's groups, made over every process
        close_rollout = _vllm_groups(cfg, inputs).close
    start, trainer_state, loop_state = 0, {}, {}
    prompts = PromptSchedule(cfg.rollout.prompts_per_step, cfg.seed, cfg.rl_steps, cfg.tail, inputs.train_size)
    if ckpt is not None:
        start, trainer_state, loop_state = restore(ckpt, dims, trainer, prompts, run_dir)
    elif cfg.sft.steps > 0:
        _sft(cfg, run_dir, inputs, dims, trainer)
    ref = None
    if trainer is not None:
        trainer.set_lr(cfg.trainer.lr)
        # reference = the policy RL starts from (after SFT; a checkpoint's holds it: check_checkpoint_fits)
        if cfg.grpo.kl_coef > 0:
            ref = ShardedReference(trainer, trainer_state.get("ref"))  # this rank's piece only
    receiver = None if trainer is not None else (dims, inputs.args, parse_dtype(cfg.trainer.dtype))
    weight_sync = WeightSync(trainer, engine, cfg.parallel.weight_sync_bucket_mb, bridge=rollout_groups.bridge,
                             receiver=receiver)
    if engine is not None:  # (vLLM: the sync fills its staging copy, then vLLM loads it)
        weight_sync = engine.after_sync(weight_sync)
    weight_sync()
    policy = BubblePolicy(cfg.schedule, cfg.spec, cfg.stream_train, cfg.rollout.device == "cpu", layout.rollout_dp)
    rollout, long_sync = NoRollout(rollout_groups.group_index), None
    if engine is not None:
        stage = RolloutStage(engine, inputs, cfg.rollout, cfg.reward, replica=rollout_groups.group_index,
                             replicas=layout.rollout_dp, dp_group=rollout_groups.dp_group,
                             tp_group=rollout_groups.tp_group)
        if ckpt is not None and "length_history" in loop_state:  # older checkpoints: placement restarts unseen
            stage.history.load_state_dict(loop_state["length_history"])
        # Elastic rollout TP: tail batching's long rounds on rollout groups of tail.long_rollout_tp.
        long_stage, long_sync = _long_round_stage(cfg, inputs, layout, trainer, stage)
        rollout = RolloutSide(stage, long_stage, policy, cfg.grpo.drop_zero_variance)
        if ckpt is not None:  # the learned drafter, its training buffer and strategy bandit
            policy.drafter_steps = restore_drafter(engine, ckpt, rollout_groups.group_index, start)
    if long_sync is not None:
        long_sync()
    side = NoTrainer() if trainer is None else TrainerSide(
        trainer, UpdateSpec.of(cfg, inputs.tokenizer.pad_id), ref, cfg.stream_train, policy.defer_stream)
    exchange = Exchange(dims, layout.rollout_ranks[0], layout.cfg.placement == "disaggregated")
    run = Run(rank=dims.rank, prompts=prompts, rollout=rollout, trainer=side, exchange=exchange, rl_steps=cfg.rl_steps,
              sync=RoundSync(weight_sync, long_sync))
    return run, start, engine, close_rollout


def _sft(cfg: RunConfig, run_dir: Path, inputs: RunInputs, dims, trainer: Trainer | None) -> None:
    """SFT warm-up on the synthetic task's worked solutions, then the step-0 checkpoint."""
    if trainer is not None:
        sft = run_sft(trainer, inputs, cfg.sft, cfg.seed, cfg.progress)
        if dims.rank == 0:
            log.info("SFT done: %s", sft)
            atomic_write_text(run_dir / "sft.json", json.dumps(sft))
        trainer.reset_optimizer()  # RL starts with fresh Adam moments: no SFT momentum carried over
    if cfg.checkpoint_every:
        save_checkpoint(run_dir, 0, trainer.checkpoint_state() if trainer is not None else None,
                        record(cfg, inputs.data_sha256), keep=cfg.keep_checkpoints, dims=dims)


def _write_step(run_dir: Path, cfg: RunConfig, result: StepResult, aborted: dict, metrics_log: MetricsLogger) -> None:
    """Rank 0: the step's metrics (metrics.jsonl, TensorBoard, W&B), its timeline.jsonl line and
    (rollout.dump) its rollouts.jsonl line."""
    step = result.metrics["step"]
    metrics_log.log(step, result.metrics)
    lengths = [len(r.tokens) for grp in result.groups for r in grp.results]
    append_line(run_dir / "timeline.jsonl", timeline_line(step, result.records, lengths))
    if cfg.rollout.dump:
        append_line(run_dir / "rollouts.jsonl", rollout_line(step, result.groups, aborted or None))


def _checkpoint(run_dir: Path, cfg: RunConfig, dims, run: Run, step: int, engine: RolloutBackend | None,
                replica: int, record: dict) -> None:
    """A resumable checkpoint after ``step`` steps: trainer and reference state, the prompt
    schedule, the length history (from the generating side), each replica's drafter, and
    ``record`` (:func:`megarl.resume.record`)."""
    stages = run.rollout.stages
    lengths_seen = run.exchange.from_generators(stages[0].history.state_dict() if stages else None)
    trainer_state, ref_state = run.trainer.state()
    save_checkpoint(run_dir, step, trainer_state, {**run.prompts.state_dict(), "length_history": lengths_seen, **record},
                    keep=cfg.keep_checkpoints, dims=dims, ref_state=ref_state,
                    rank_files=drafter_files(engine.spec, replica) if engine is not None else None)


def _export(run_dir: Path, inputs: RunInputs, dims, run: Run, engine: RolloutBackend | None, layout: Layout) -> None:
    """The final policy as a HF folder (every trainer process takes part) and the learned
    drafter beside it (identical on every replica: the first generating process writes it)."""
    if run.trainer.trainer is not None:
        export_hf(run.trainer.trainer, run_dir / "hf", write_extra=inputs.tokenizer.save_pretrained)  # collective
        if dims.rank == 0:
            log.info("exported HF checkpoint to %s", run_dir / "hf")
    if layout.cfg.placement == "disaggregated":
        dist.barrier()  # the export is in place before a generating process adds the drafter to it
    spec = engine.spec if engine is not None else None
    if dims.rank == layout.rollout_ranks[0] and spec is not None and spec.drafter_ready:
        from megarl.spec.drafter import save_drafter

        save_drafter(spec.drafter.model, run_dir / "hf" / "drafter")


def _make_engine(cfg: RunConfig, inputs: RunInputs, rollout_tp: int, tp_group) -> RolloutBackend:
    """This process's rollout engine (``rollout.backend``); with rollout TP its rollout group runs
    the model tensor-parallel (megarl's engine only: the set-up refuses it with vLLM)."""
    if cfg.rollout.backend == "vllm":
        return VLLMEngine(inputs.args, cfg.rollout.engine_config(inputs.max_seq_len), cfg.seed,
                          cfg.rollout.temperature, spec=Speculator(cfg.spec) if cfg.spec.enabled else None,
                          vllm_spec=cfg.rollout.vllm_spec)
    policy = TPCausalLM(inputs.args, tp_group) if rollout_tp > 1 else CausalLM(inputs.args)
    return Engine(policy, cfg.rollout.engine_config(inputs.max_seq_len), seed=cfg.seed,
                  spec=Speculator(cfg.spec) if cfg.spec.enabled else None)


def _vllm_groups(cfg: RunConfig, inputs: RunInputs) -> VLLMGroups:
    """vLLM's process groups on a process that does not generate (disaggregated placement), made
    with the arguments of the generating processes' vLLM (:func:`_make_engine`), at the point where
    those start it (megarl/engine/vllm_groups.py)."""
    spec = speculative_config(cfg.rollout.vllm_spec, cfg.spec.k_max if cfg.spec.enabled else 0)
    return VLLMGroups(inputs.args, cfg.rollout.engine_config(inputs.max_seq_len), cfg.seed, cfg.rollout.temperature,
                      spec)


def _long_round_stage(cfg: RunConfig, inputs: RunInputs, layout: Layout, trainer, short: RolloutStage | None):
    """Elastic rollout TP (``tail.long_rollout_tp``, megarl/sched/tail.py): the rollout stage of tail
    batching's long rounds, on rollout groups of that TP (created here, on every process), and the
    weight sync into its engine; (None, None) without it. Placement shares the short rounds'
    length history."""
    long_tp = cfg.tail.long_rollout_tp
    if long_tp in (0, layout.cfg.rollout_tp):
        return None, None
    a = inputs.args
    long_layout = Layout.build(dataclasses.replace(layout.cfg, rollout_tp=long_tp), layout.world_size,
                               a.num_attention_heads, a.num_key_value_heads, a.num_hidden_layers,
                               getattr(a, "num_experts", 0) or 0)
    rollout_groups = create_rollout_groups(long_layout)
    engine = _make_engine(cfg, inputs, long_tp, rollout_groups.tp_group)
    stage = RolloutStage(engine, inputs, cfg.rollout, cfg.reward, replica=rollout_groups.group_index,
                         replicas=long_layout.rollout_dp, dp_group=rollout_groups.dp_group,
                         tp_group=rollout_groups.tp_group)
    stage.history = short.history
    return stage, WeightSync(trainer, engine, cfg.parallel.weight_sync_bucket_mb)


def set_deterministic() -> None:
    """Bitwise-repeatable runs (docs/design.md §1: a resumed run repeats the uninterrupted run)."""
    # cuBLAS needs a fixed workspace for deterministic matmuls; read at the first cuBLAS call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
