"""The synchronous GRPO run: SFT warm-up, then per step rollout -> rewards -> train -> weight sync.

The top-level loop stays one screen long (slime's train.py); each stage lives in its module.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from megarl.checkpoint.rl_state import latest_checkpoint, load_checkpoint, save_checkpoint
from megarl.config import RunConfig, dump_config
from megarl.engine import Engine, EngineConfig
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
from megarl.spec.speculator import Speculator
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
    dims = init_distributed(tp=p.trainer_tp, pp=p.trainer_pp, ep=p.trainer_ep, vpp=p.trainer_vpp)
    try:
        # Inside the try: the watchdog stops (a store barrier) before the process group goes, and
        # before PreemptSignals raises Preempted (exit 75) after a signal's checkpoint.
        preempt = PreemptSignals(device=dims.device, record=run_dir / RECORD_NAME if rank0 else None)
        with preempt, RankWatchdog(cfg.watchdog):
            layout = inputs.layout or check_layout(cfg, inputs.args, dims.world_size)
            check_trainer_groups(layout, dims.tp_group, dims.pp_group, dims.dp_group)
            if dims.rank == 0:
                log.info("process layout: %s", layout.describe())
            return _train(cfg, run_dir, inputs, ckpt, dims, create_rollout_groups(layout), layout, preempt)
    finally:
        shutdown_distributed(dims)


def _train(cfg: RunConfig, run_dir: Path, inputs: RunInputs, ckpt: Path | None, dims, groups: RolloutGroups,
           layout: Layout, preempt: PreemptSignals | None = None) -> list[dict]:
    rank0 = dims.rank == 0
    trainer = Trainer(inputs.args, cfg.trainer, dims, hf_dir=inputs.init_from_hf, mcore_dir=inputs.init_from_mcore,
                      seed=cfg.seed)
    # Rollout TP: this process's rollout group runs the engine's model tensor-parallel.
    policy = TPCausalLM(inputs.args, groups.tp_group) if layout.cfg.rollout_tp > 1 else CausalLM(inputs.args)
    engine = Engine(policy, EngineConfig(
        max_batch_size=cfg.rollout.max_batch_size, max_seq_len=inputs.args.max_position_embeddings,
        dtype=cfg.rollout.dtype, device=cfg.rollout.device), seed=cfg.seed,
        spec=Speculator(cfg.spec) if cfg.spec.enabled else None)
    start, trainer_state = 0, {}
    prompts = PromptSchedule(cfg, len(inputs.problems))
    if ckpt is not None:
        trainer_state, loop_state = load_checkpoint(ckpt, dims)
        trainer.load_state_dict(trainer_state)
        start = loop_state["step"]
        prompts.load_state_dict(loop_state)
        if rank0:
            _truncate_metrics(run_dir / "metrics.jsonl", start)
            _truncate_metrics(run_dir / "timeline.jsonl", start)
            _truncate_metrics(run_dir / "rollouts.jsonl", start)
        log.info("resumed from %s (step %d)", ckpt, start)
    elif cfg.sft.steps > 0:
        sft = run_sft(trainer, inputs, cfg)
        if rank0:
            log.info("SFT done: %s", sft)
            atomic_write_text(run_dir / "sft.json", json.dumps(sft))
        trainer.reset_optimizer()  # RL starts with fresh Adam moments: no SFT momentum carried over
        trainer.set_lr(cfg.trainer.lr)
        if cfg.checkpoint_every:
            save_checkpoint(run_dir, 0, trainer.state_dict(), {}, keep=cfg.keep_checkpoints, dims=dims)
    trainer.set_lr(cfg.trainer.lr)
    ref = None
    if cfg.grpo.kl_coef > 0:  # reference = the policy RL starts from (after SFT)
        if start > 0 and "ref" not in trainer_state:
            raise RunDirError(f"{ckpt} holds no reference policy (it was written with grpo.kl_coef=0); "
                              f"resume with grpo.kl_coef=0")
        ref = CausalLM(inputs.args).to(torch.float64 if cfg.trainer.dtype == "float64" else torch.float32)
        ref.load_state_dict(trainer_state.get("ref") or trainer.hf_state_dict())
    weight_sync = WeightSync(trainer, engine, cfg.parallel.weight_sync_bucket_mb)
    weight_sync()
    rollout = RolloutStage(engine, inputs, cfg, replica=groups.group_index, replicas=layout.rollout_dp,
                           dp_group=groups.dp_group, tp_group=groups.tp_group)
    if ckpt is not None and "length_history" in loop_state:  # older checkpoints: placement restarts unseen
        rollout.history.load_state_dict(loop_state["length_history"])
    sched = _Schedule(cfg, layout.rollout_dp)
    replica = groups.group_index
    history = []
    bar = tqdm(range(start, cfg.rl_steps), desc="GRPO", disable=not cfg.progress or not rank0, initial=start,
               total=cfg.rl_steps)
    for step in bar:
        tl = StepTimeline(dims.rank, replica)
        t0 = tl.t0
        rnd = prompts.round(step)
        next_uids = prompts.next_uids(step, rnd)
        stream = StreamUpdate(trainer, cfg, inputs, ref, defer=sched.defer_stream) if cfg.stream_train else None
        if stream is not None:
            stream.begin()
        groups = rollout.run(rnd.uids, step, on_group=stream.add_group if stream is not None else None, timeline=tl,
                             bubble=sched.bubble_fn(rollout, stream, tl, next_uids, step),
                             low_priority=sched.low_priority, keep=rnd.keep)
        rollout_metrics = {**rollout.metrics(groups), **prompts.commit(rnd, [g.problem.uid for g in groups])}
        if cfg.grpo.drop_zero_variance:
            rollout_metrics["zero_var_dropped"] = len(groups) - len(trained_groups(groups, cfg))
        t1 = time.perf_counter()
        rollout.wait_bubble()  # a stream-training unit may still be in flight (its time is its own "train")
        if sched.pregen_after and next_uids is not None:
            # No idle replica to do it in (one replica, or pregen not in schedule.bubble_work):
            # bubble drafts made after the rollout, with the weights that sampled this step.
            with tl.phase("bubble"):
                tl.bubble_tokens = rollout.pregenerate(next_uids, step + 1)
        drafter_metrics = sched.drafter_after_rollout(engine, tl, groups_dp=rollout.dp_group)
        rollout.share_drafts(step)
        t_bubble = time.perf_counter()
        with tl.phase("train"):
            metrics = stream.finish(groups) if stream is not None else grpo_update(trainer, groups, cfg, inputs, ref)
        t2 = time.perf_counter()
        with tl.phase("sync"):
            metrics.update(weight_sync())
        records = gather_records(tl.record())
        metrics.update(step=step + 1, **rollout_metrics, **drafter_metrics, rollout_time_s=t1 - t0,
                       bubble_time_s=t_bubble - t1,
                       train_time_s=t2 - t_bubble, step_time_s=time.perf_counter() - t0,
                       bubble_frac=bubble_fraction(records), bubble_tokens=replica_sum(records, "bubble_tokens"),
                       bubble_groups=replica_sum(records, "bubble_groups"))
        history.append(metrics)
        if rank0:
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
            lengths = [len(r.tokens) for grp in groups for r in grp.results]
            with open(run_dir / "timeline.jsonl", "a") as f:
                f.write(json.dumps(timeline_line(step + 1, records, lengths)) + "\n")
            if cfg.rollout.dump:
                with open(run_dir / "rollouts.jsonl", "a") as f:
                    f.write(json.dumps(rollout_line(step + 1, groups)) + "\n")
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", len=f"{metrics['response_len_mean']:.0f}")
        stop = preempt is not None and preempt.agree()  # a signal on any rank: all stop after this step
        if stop or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0):
            loop_state = {**prompts.state_dict(), "length_history": rollout.history.state_dict()}
            save_checkpoint(run_dir, step + 1, trainer.state_dict(), loop_state, keep=cfg.keep_checkpoints,
                            dims=dims, ref_state=ref.state_dict() if ref is not None else None)
        if stop:
            preempt.stop(step + 1)
            break
    rollout.close()
    if preempt is not None and preempt.stopped_at is not None:
        return history  # unfinished: no export (leaving PreemptSignals raises Preempted)
    export_hf(trainer, run_dir / "hf", write_extra=inputs.tokenizer.save_pretrained)  # collective
    if rank0:
        log.info("exported HF checkpoint to %s", run_dir / "hf")
        if sched.drafter is not None and engine.spec.drafter.model is not None:  # identical on every replica
            from megarl.spec.drafter import save_drafter

            save_drafter(engine.spec.drafter.model, run_dir / "hf" / "drafter")
    return history


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
