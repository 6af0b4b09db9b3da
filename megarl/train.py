"""The synchronous GRPO run: SFT warm-up, then per step rollout -> rewards -> train -> weight sync.

The top-level loop stays one screen long (slime's train.py); each stage lives in its module.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from megarl.checkpoint.rl_state import latest_checkpoint, load_checkpoint, save_checkpoint
from megarl.config import RunConfig, dump_config
from megarl.engine import Engine
from megarl.engine.tp_model import TPCausalLM
from megarl.checkpoint.export import export_hf
from megarl.models.llama import CausalLM
from megarl.parallel.dist import init_distributed, shutdown_distributed
from megarl.parallel.launch_env import export_launch_env
from megarl.parallel.layout import Layout, RolloutGroups, check_trainer_groups, create_rollout_groups
from megarl.parallel.preempt import RECORD_NAME, PreemptSignals
from megarl.parallel.watchdog import RankWatchdog
from megarl.parallel.weight_sync import WeightSync
from megarl.rl.rollout import RolloutStage, rollout_line
from megarl.rl.sft import run_sft
from megarl.rl.timeline import StepTimeline, bubble_fraction, gather_records, replica_sum, timeline_line
from megarl.rl.tail import PromptSchedule
from megarl.rl.update import StreamUpdate, grpo_update, trained_groups
from megarl.setup_run import RunInputs, check_layout, prepare_inputs
from megarl.spec.drafter_state import drafter_files, restore_drafter
from megarl.spec.speculator import Speculator
from megarl.stream_train.model import parse_dtype
from megarl.stream_train.trainer import Trainer
from megarl.utils.fs import atomic_write_text

log = logging.getLogger("megarl")
# Metrics that measure time: everything else in metrics.jsonl is a deterministic function of the
# config (a resumed run reproduces it exactly).
TIME_KEYS = ("rollout_time_s", "train_time_s", "step_time_s", "weight_sync_s", "weight_sync_gbps", "bubble_time_s",
             "stream_train_time_s", "bubble_frac", "bubble_tokens", "bubble_groups", "reward_timeout_s",
             "drafter_train_steps", "drafter_loss")


class RunDirError(ValueError):
    """The run directory does not fit the request (exists without --resume, nothing to resume)."""


def check_run_dir(run_dir: Path, resume: bool) -> Path | None:
    """Decide where to start before touching anything; returns the checkpoint to resume from."""
    if resume:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise RunDirError(f"--resume: no checkpoint under {run_dir / 'checkpoints'} to resume from")
        return ckpt
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        raise RunDirError(f"run dir {run_dir} already holds a run: pass --resume to continue it, "
                          f"or choose another --run-dir")
    return None


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False, inputs: RunInputs | None = None) -> list[dict]:
    """Run ``cfg`` in ``run_dir``; returns the metrics of the steps run by this call."""
    run_dir = Path(run_dir)
    export_launch_env()  # srun/MPI ranks as torchrun's RANK/WORLD_SIZE, before anything reads them
    inputs = inputs or prepare_inputs(cfg)  # all bad input fails here, before anything is written
    ckpt = check_run_dir(run_dir, resume)
    rank0 = int(os.environ.get("RANK", "0")) == 0  # the process that writes run-level files
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "config.yaml", dump_config(cfg))
    if cfg.deterministic:
        set_deterministic()
    p = cfg.parallel
    trainers = None  # disaggregated: the first world - rollout_ranks processes train (Megatron's world)
    if p.placement == "disaggregated":
        trainers = int(os.environ.get("WORLD_SIZE", "1")) - p.rollout_ranks
    dims = init_distributed(tp=p.trainer_tp, pp=p.trainer_pp, ep=p.trainer_ep, vpp=p.trainer_vpp,
                            trainer_ranks=trainers)
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
            return _train(cfg, run_dir, inputs, ckpt, dims, create_rollout_groups(layout), layout, preempt)
    finally:
        shutdown_distributed(dims)


def _train(cfg: RunConfig, run_dir: Path, inputs: RunInputs, ckpt: Path | None, dims, groups: RolloutGroups,
           layout: Layout, preempt: PreemptSignals | None = None) -> list[dict]:
    rank0 = dims.rank == 0
    # Colocated: every process trains and generates. Disaggregated: a process does one of the two
    # (dims.role); the groups go from the first generating process to the trainers, the weights back.
    apart = layout.cfg.placement == "disaggregated"
    first_gen = layout.rollout_ranks[0]  # sends the step's groups to the trainers (disaggregated)
    trainer = engine = None
    if dims.trains:
        trainer = Trainer(inputs.args, cfg.trainer, dims, hf_dir=inputs.init_from_hf,
                          mcore_dir=inputs.init_from_mcore, seed=cfg.seed)
    if dims.generates:
        engine = _make_engine(cfg, inputs, layout.cfg.rollout_tp, groups.tp_group)
    start, trainer_state, loop_state = 0, {}, {}
    prompts = PromptSchedule(cfg, len(inputs.problems))
    if ckpt is not None:
        trainer_state, loop_state = load_checkpoint(ckpt, dims)
        if trainer is not None:
            trainer.load_state_dict(trainer_state)
        start = loop_state["step"]
        prompts.load_state_dict(loop_state)
        if rank0:
            _truncate_metrics(run_dir / "metrics.jsonl", start)
            _truncate_metrics(run_dir / "timeline.jsonl", start)
            _truncate_metrics(run_dir / "rollouts.jsonl", start)
        log.info("resumed from %s (step %d)", ckpt, start)
    elif cfg.sft.steps > 0:
        if trainer is not None:
            sft = run_sft(trainer, inputs, cfg)
            if rank0:
                log.info("SFT done: %s", sft)
                atomic_write_text(run_dir / "sft.json", json.dumps(sft))
            trainer.reset_optimizer()  # RL starts with fresh Adam moments: no SFT momentum carried over
            trainer.set_lr(cfg.trainer.lr)
        if cfg.checkpoint_every:
            save_checkpoint(run_dir, 0, trainer.state_dict() if trainer is not None else None, {},
                            keep=cfg.keep_checkpoints, dims=dims)
    ref = None
    if trainer is not None:
        trainer.set_lr(cfg.trainer.lr)
        if cfg.grpo.kl_coef > 0:  # reference = the policy RL starts from (after SFT)
            if start > 0 and "ref" not in trainer_state:
                raise RunDirError(f"{ckpt} holds no reference policy (it was written with grpo.kl_coef=0); "
                                  f"resume with grpo.kl_coef=0")
            ref = CausalLM(inputs.args).to(torch.float64 if cfg.trainer.dtype == "float64" else torch.float32)
            ref.load_state_dict(trainer_state.get("ref") or trainer.hf_state_dict())
    receiver = None if trainer is not None else (dims, inputs.args, parse_dtype(cfg.trainer.dtype))
    weight_sync = WeightSync(trainer, engine, cfg.parallel.weight_sync_bucket_mb, bridge=groups.bridge,
                             receiver=receiver)
    weight_sync()
    replica = groups.group_index
    rollout = None
    if engine is not None:
        rollout = RolloutStage(engine, inputs, cfg, replica=replica, replicas=layout.rollout_dp,
                               dp_group=groups.dp_group, tp_group=groups.tp_group)
        if ckpt is not None and "length_history" in loop_state:  # older checkpoints: placement restarts unseen
            rollout.history.load_state_dict(loop_state["length_history"])
    # Elastic rollout TP: tail batching's long rounds on rollout groups of tail.long_rollout_tp.
    long_stage, long_sync = _long_round_stage(cfg, inputs, layout, trainer, rollout)
    if long_sync is not None:
        long_sync()
    sched = _Schedule(cfg, layout.rollout_dp)
    if ckpt is not None and engine is not None:  # the learned drafter, its training buffer and strategy bandit
        sched._drafter_steps = restore_drafter(engine, ckpt, replica, start)
    history = []
    bar = tqdm(range(start, cfg.rl_steps), desc="GRPO", disable=not cfg.progress or not rank0, initial=start,
               total=cfg.rl_steps)
    for step in bar:
        rnd = prompts.round(step)
        stage = long_stage if rnd.long and long_stage is not None else rollout  # (None: a trainer-only process)
        tl = StepTimeline(dims.rank, stage.replica if stage is not None else replica)
        t0 = tl.t0
        next_uids = prompts.next_uids(step, rnd)
        stream = StreamUpdate(trainer, cfg, inputs, ref, defer=sched.defer_stream) if cfg.stream_train else None
        if stream is not None:
            stream.begin()
        groups, rollout_metrics = [], {}
        if stage is not None:
            groups = stage.run(rnd.uids, step, on_group=stream.add_group if stream is not None else None,
                               timeline=tl, bubble=sched.bubble_fn(stage, stream, tl, next_uids, step),
                               low_priority=sched.low_priority, keep=rnd.keep)
            rollout_metrics = {**stage.metrics(groups), **prompts.commit(rnd, [g.problem.uid for g in groups])}
            if long_stage is not None:
                rollout_metrics["rollout_tp"] = float(stage.engine.tp_size)
            if cfg.grpo.drop_zero_variance:
                rollout_metrics["zero_var_dropped"] = len(groups) - len(trained_groups(groups, cfg))
        if apart:  # the trainers get the step's groups; the generating processes go on with their bubble work
            groups, rollout_metrics = _from_first_generator(dims, first_gen, (groups, rollout_metrics))
            if trainer is not None:
                prompts.commit(rnd, [g.problem.uid for g in groups])
                tl.end_rollout()
        t1 = time.perf_counter()
        drafter_metrics = {}
        if stage is not None:
            stage.wait_bubble()  # a stream-training unit may still be in flight (its time is its own "train")
            if sched.pregen_after and next_uids is not None:
                # No idle replica to do it in (one replica, or pregen not in schedule.bubble_work):
                # bubble drafts made after the rollout, with the weights that sampled this step.
                with tl.phase("bubble"):
                    tl.bubble_tokens = stage.pregenerate(next_uids, step + 1)
            drafter_metrics = sched.drafter_after_rollout(stage.engine, tl, groups_dp=stage.dp_group)
            stage.share_drafts(step)
        t_bubble = time.perf_counter()
        metrics = {}
        if trainer is not None:
            with tl.phase("train"):
                metrics = stream.finish(groups) if stream is not None else grpo_update(trainer, groups, cfg, inputs, ref)
        t2 = time.perf_counter()
        with tl.phase("sync"):  # into the engine the next round runs on (two with elastic rollout TP)
            next_long = long_sync is not None and step + 1 < cfg.rl_steps and prompts.round(step + 1).long
            metrics.update(long_sync() if next_long else weight_sync())
        if apart:
            drafter_metrics = _from_first_generator(dims, first_gen, drafter_metrics)
        records = gather_records(tl.record())
        generating = [r for r in records if r["replica"] >= 0]  # (trainer-only processes have none)
        metrics.update(step=step + 1, **rollout_metrics, **drafter_metrics, rollout_time_s=t1 - t0,
                       bubble_time_s=t_bubble - t1,
                       train_time_s=t2 - t_bubble, step_time_s=time.perf_counter() - t0,
                       bubble_frac=bubble_fraction(generating), bubble_tokens=replica_sum(generating, "bubble_tokens"),
                       bubble_groups=replica_sum(generating, "bubble_groups"))
        history.append(metrics)
        if rank0:
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
            lengths = [len(r.tokens) for grp in groups for r in grp.results]
            with open(run_dir / "timeline.jsonl", "a") as f:
                f.write(json.dumps(timeline_line(step + 1, records, lengths)) + "\n")
            if cfg.rollout.dump:
                with open(run_dir / "rollouts.jsonl", "a") as f:
                    f.write(json.dumps(rollout_line(step + 1, groups, stage.aborted if stage is not None else None))
                            + "\n")
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", len=f"{metrics['response_len_mean']:.0f}")
        stop = preempt is not None and preempt.agree()  # a signal on any rank: all stop after this step
        if stop or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0):
            lengths_seen = rollout.history.state_dict() if rollout is not None else None
            if apart:  # rank 0 writes the loop state; the length history lives with the generators
                lengths_seen = _from_first_generator(dims, first_gen, lengths_seen)
            loop_state = {**prompts.state_dict(), "length_history": lengths_seen}
            save_checkpoint(run_dir, step + 1, trainer.state_dict() if trainer is not None else None, loop_state,
                            keep=cfg.keep_checkpoints, dims=dims, ref_state=ref.state_dict() if ref is not None else None,
                            rank_files=drafter_files(engine.spec, replica) if engine is not None else None)
        if stop:
            preempt.stop(step + 1)
            break
    for s in (rollout, long_stage):
        if s is not None:
            s.close()
    if preempt is not None and preempt.stopped_at is not None:
        return history  # unfinished: no export (leaving PreemptSignals raises Preempted)
    if trainer is not None:
        export_hf(trainer, run_dir / "hf", write_extra=inputs.tokenizer.save_pretrained)  # collective
        if rank0:
            log.info("exported HF checkpoint to %s", run_dir / "hf")
    if apart:
        dist.barrier()  # the export is in place before a generating process adds the drafter to it
    if dims.rank == first_gen and sched.drafter is not None and engine.spec.drafter.model is not None:
        from megarl.spec.drafter import save_drafter  # (identical on every replica)

        save_drafter(engine.spec.drafter.model, run_dir / "hf" / "drafter")
    return history


def _make_engine(cfg: RunConfig, inputs: RunInputs, rollout_tp: int, tp_group) -> Engine:
    """This process's rollout engine; with rollout TP its rollout group runs the model tensor-parallel."""
    policy = TPCausalLM(inputs.args, tp_group) if rollout_tp > 1 else CausalLM(inputs.args)
    return Engine(policy, cfg.rollout.engine_config(inputs.max_seq_len), seed=cfg.seed,
                  spec=Speculator(cfg.spec) if cfg.spec.enabled else None)


def _long_round_stage(cfg: RunConfig, inputs: RunInputs, layout: Layout, trainer, short: RolloutStage | None):
    """Elastic rollout TP (``tail.long_rollout_tp``, megarl/rl/tail.py): the rollout stage of tail
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
    groups = create_rollout_groups(long_layout)
    engine = _make_engine(cfg, inputs, long_tp, groups.tp_group)
    stage = RolloutStage(engine, inputs, cfg, replica=groups.group_index, replicas=long_layout.rollout_dp,
                         dp_group=groups.dp_group, tp_group=groups.tp_group)
    stage.history = short.history
    return stage, WeightSync(trainer, engine, cfg.parallel.weight_sync_bucket_mb)


def _from_first_generator(dims, first_gen: int, obj):
    """``obj`` as the first generating process has it, on every process (disaggregated placement:
    what the trainers need from the generating side)."""
    box = [obj if dims.rank == first_gen else None]
    dist.broadcast_object_list(box, src=first_gen)
    return box[0]


class _Schedule:
    """Where this run's bubble work goes (``schedule`` section): with several rollout replicas,
    into each replica's idle time in the rollout phase; otherwise (or when not listed in
    ``schedule.bubble_work``) stream training happens as groups finish and bubble drafts are
    made after the rollout."""

    def __init__(self, cfg: RunConfig, replicas: int):
        work = cfg.schedule.bubble_work if replicas > 1 else ()
        pregen = cfg.spec.enabled and cfg.spec.bubble_pregen
        self.defer_stream = cfg.stream_train and "stream_train" in work
        self.pregen_in_bubble = pregen and "pregen" in work
        # The learned drafter (spec.drafter) trains in bubbles, or else a fixed number of steps after the rollout.
        self.drafter = cfg.spec.drafter if cfg.spec.enabled and cfg.spec.drafter.enabled else None
        self.drafter_in_bubble = self.drafter is not None and "drafter_train" in work
        self.order = [w for w in work if {"stream_train": self.defer_stream, "pregen": self.pregen_in_bubble,
                                          "drafter_train": self.drafter_in_bubble}[w]]
        self.pregen_after = pregen and not self.pregen_in_bubble
        self.low_priority = cfg.schedule.bubble_priority == "idle" and cfg.rollout.device == "cpu"
        self._drafter_steps = 0  # drafter training steps taken so far (a step's figure is the difference)

    def drafter_after_rollout(self, engine: Engine, tl: StepTimeline, groups_dp) -> dict:
        """After the rollout phase (bubble work joined): the drafter's training steps when there was
        no bubble to take them in, then the same drafter weights on every rollout replica (their mean
        over the rollout data-parallel group). Figures for metrics.jsonl."""
        if self.drafter is None:
            return {}
        from megarl.spec.drafter_train import average_drafter

        source = engine.spec.drafter
        if source.trainer is None:  # attached at the first generate call
            return {}
        if not self.drafter_in_bubble and self.drafter.steps_after_rollout:
            with tl.phase("bubble"):
                source.trainer.train(max_steps=self.drafter.steps_after_rollout)
        average_drafter(source.model, groups_dp)
        steps, self._drafter_steps = source.trainer.steps - self._drafter_steps, source.trainer.steps
        return {"drafter_train_steps": steps, "drafter_loss": source.trainer.last_loss or 0.0,
                "drafter_buffer_tokens": source.buffer.tokens}

    def bubble_fn(self, rollout: RolloutStage, stream: StreamUpdate | None, tl: StepTimeline,
                  next_uids: list[int] | None, step: int):
        if not (self.defer_stream or (self.pregen_in_bubble and next_uids is not None) or self.drafter_in_bubble):
            return None

        def work(stop) -> dict:
            for what in self.order:  # schedule.bubble_work's order: its priority
                if stop():
                    break
                if what == "stream_train":
                    with tl.phase("train"):
                        tl.bubble_groups = stream.drain(stop)
                elif what == "drafter_train":
                    if rollout.engine.spec.drafter.trainer is not None:
                        with tl.phase("bubble"):
                            rollout.engine.spec.drafter.trainer.train(stop, max_steps=self.drafter.steps_per_bubble)
                elif next_uids is not None:
                    with tl.phase("bubble"):
                        tl.bubble_tokens = rollout.pregenerate(next_uids, step + 1, should_stop=stop)
            return {}  # figures go to the timeline (summed over replicas there)

        return work


def set_deterministic() -> None:
    """Bitwise-repeatable runs (DESIGN.md §2: a resumed run repeats the uninterrupted run)."""
    # cuBLAS needs a fixed workspace for deterministic matmuls; read at the first cuBLAS call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines of steps after the checkpoint: they will be run again."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    atomic_write_text(path, "".join(ln + "\n" for ln in lines))
