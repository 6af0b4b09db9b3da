"""Calibrate the simulator's ``cpu`` profile on this machine (megarl/sim/hardware.py LinearProfile).

    .venv/bin/python benchmarks/calibrate_sim.py [--config configs/tiny.yaml] [--from-hf SFT_HF_DIR]
        [--out megarl/sim/profiles/cpu.json]

What it times, all with ONE torch thread (torchrun gives each worker one, and that is how
``megarl bench schedule`` runs), best of ``--repeat`` to keep other load out of the figures
(contention and interference: medians, see 3.):

1. **Engine decode** (megarl/engine/engine.py): ``generate`` of B requests that never stop
   (no stop token) for L tokens, over a grid of B and L; groups of 8 share a prompt, as in GRPO.
   Each run is L engine iterations of B rows with context B*(p+i) at iteration i, plus one
   prompt-caching forward. Least squares fits ``a + b * rows + c * ctx`` per iteration
   (``decode_a, decode_b, decode_c``); the prefill line comes from timing prompt caching alone.
2. **Trainer** (megarl/trainer/trainer.py, Megatron-core on gloo, one process): old-logprob
   forward (``masked_logprobs``) and forward/backward (``accumulate``) of synthetic batches of
   several row counts and widths, fitted per micro-batch as ``a + b * padded tokens + c * padded
   tokens * width`` (attention is quadratic in the width); the
   optimizer step (``finish_step``) and a weight sync into the engine timed as they are.
With ``--from-hf`` (a trained policy: its responses stop at realistic lengths), ``--real-steps``
real RL steps are timed too: the run's own rollout stage (reward pool, stop tokens, slot
compaction), the plain GRPO update and stream training of those groups. The synthetic grids give
the shape of each fit (a vs b vs c); the real steps give one scale on it (the median of measured
over predicted, the prediction being the simulator's own for the lengths they produced): alone
they cannot separate a from b, since every real step has about the same batch profile. Without
them the synthetic grid under-predicts real rollouts by ~15-25% (requests finishing at different
times cost host work the grid does not have).

3. **Contention**: a fixed piece of work (the decode loop; the trainer's forward/backward) in 1, 2
   and 4 processes at once (2 cores), each in its own session as torchrun starts them, started and
   released together (megarl/sim/probe.py), alternating 1-process and n-process probes:
   ``slowdown["2"]`` is the 2-process time over one alone (shared caches and memory bandwidth),
   ``slowdown["4"]`` the 4-process time over one alone and over time-sharing (4 / cores): 4
   processes on 2 cores cost more than the split (context switches refill the caches: probes
   1.1-1.2x, real runs up to 1.5x).
   ``train_slowdown``: the same for forward/backward passes. megarl/sim/share.py interpolates
   between the counts. With ``--from-hf`` these probe figures only go into ``meta``
   (``probe_slowdown``): both tables are fitted on real runs instead (``--real-procs``, 2 and 4
   processes: ``megarl train``'s plain synchronous baseline on another seed than the runs being
   validated, replayed with the one-process figures: measured over predicted generate phase and
   training phase). Real runs contend more than the clean probe loops (the replicas' exchange,
   the gradient all-reduce over gloo, the reward pool, the waiting processes).
4. **Bubble interference**: the decode loop of 2 processes beside 2 idle-priority workers (the
   priority megarl's bubble work gets) doing forward/backward passes (stream training), or
   decoding (pre-generation), over the same 2 processes alone, alternately: ``bubble_interference``
   by kind.
5. **Speculation**: with ``--from-hf``, the real steps again with speculation on (the config's
   sources; the same tokens), once as they come (few drafts) and once with each step's bubble
   drafts pre-generated first (long drafts, all accepted): their excess over the decode fit for
   their forwards and rows gives ``spec_request`` (per running request per iteration: drafting)
   and ``spec_row`` (per draft token: verifying and accepting it).

6. **Speed reference** (megarl/sim/probe.py ``SpeedReference``: a fixed one-process decode probe
   on the default model, ``--speed-ref`` timings at a time): timed before, between and after the
   one-process parts (``meta.speed_ref``: how fast the machine was for the figures in seconds),
   and right before and after each real run of 3., whose predictions are scaled by the ratio
   (``LinearProfile.at_speed``) so that the contention factors do not also hold the machine's
   drift. ``megarl bench schedule --speed-ref N`` records the same around each run and
   benchmarks/validate_sim.py scales this profile to each run's speed.

The machine's load average before and after goes into ``meta``: other work on the cores
inflates every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from megarl.sim import probe
from megarl.sim.probe import SpeedProbe, SpeedReference, alternate, speed_ratio


def time_decode(cfg, inputs, batch: int, length: int, prompt_len: int, repeat: int) -> float:
    eng = probe.make_engine(cfg, inputs, batch)
    reqs = probe.decode_requests(batch, length, prompt_len, inputs.args.vocab_size)
    eng.generate(reqs[: min(batch, 8)], step=0)  # warm-up
    best = np.inf
    for r in range(repeat):
        t0 = time.perf_counter()
        eng.generate(reqs, step=r + 1)
        best = min(best, time.perf_counter() - t0)
    return best


def time_prefill(cfg, inputs, batch: int, prompt_len: int, repeat: int) -> float:
    """One engine iteration of 1 token after caching the prompts, minus nothing: measured as
    generate(max_new_tokens=1), i.e. prefill + one decode row per request."""
    eng = probe.make_engine(cfg, inputs, batch)
    reqs = probe.decode_requests(batch, 1, prompt_len, inputs.args.vocab_size)
    eng.generate(reqs, step=0)
    best = np.inf
    for r in range(repeat):
        t0 = time.perf_counter()
        eng.generate(reqs, step=r + 1)
        best = min(best, time.perf_counter() - t0)
    return best


def real_rollouts(cfg, inputs, steps: int, spec: bool = False, pregen: bool = False) -> list[dict]:
    """The run's own rollout stage (megarl/rollout/stage.py: engine, reward pool, stop tokens, slot
    compaction) on the task's first ``steps`` steps, timed: what the synthetic grid leaves out
    (requests finishing at different times) is in these. With ``spec``, speculative (the same
    tokens), with each step's tokens and draft rows per target forward; with ``pregen`` too, each
    step's bubble drafts pre-generated first (untimed: long drafts, all accepted)."""
    from megarl.sched.prompts import prompt_uids_for_step
    from megarl.rollout.stage import RolloutStage

    eng = probe.make_engine(cfg, inputs, cfg.rollout.max_batch_size, spec=spec)
    if inputs.init_from_hf:
        from megarl.models.hf_io import load_hf_model

        eng.load_weights(dict(load_hf_model(inputs.init_from_hf, eng.dtype).state_dict()))
    stage = RolloutStage(eng, inputs, cfg.rollout, cfg.reward)
    out = []
    try:
        stage.run(prompt_uids_for_step(steps, cfg.rollout.prompts_per_step, cfg.seed, len(inputs.problems))[:4], steps)  # warm-up
        for step in range(steps):
            uids = prompt_uids_for_step(step, cfg.rollout.prompts_per_step, cfg.seed, len(inputs.problems))
            if pregen:
                stage.pregenerate(uids, step)
            t0 = time.perf_counter()
            groups = stage.run(uids, step)
            sec = time.perf_counter() - t0
            lens = np.array([[len(r.tokens) for r in g.results] for g in groups])
            plen = np.array([len(g.results[0].prompt_ids) for g in groups])
            m = stage.metrics(groups)
            out.append({"lens": lens, "prompt": plen, "seconds": sec, "groups": groups, "forwards": m["target_forwards"],
                        "tau": m["rollout_tokens"] / m["target_forwards"],
                        "draft": m.get("drafted_tokens", 0) / m["target_forwards"]})
            print(f"real rollout step {step}{' (speculative)' if spec else ''}{' (bubble drafts)' if pregen else ''}: {lens.size} responses, max {lens.max()}, "
                  f"{sec:.3f}s, {out[-1]['tau']:.2f} tokens and {out[-1]['draft']:.2f} draft rows per forward", flush=True)
    finally:
        stage.close()
    return out


def _basis(lens, prompt, group: int, max_batch: int, **coef) -> float:
    """Simulated time of one rollout with a profile whose only nonzero figure is ``coef``: the
    design-matrix column of that figure (the event sequence does not depend on the costs)."""
    from megarl.sim.hardware import LinearProfile
    from megarl.sim.rollout import run_rollout

    base = {"decode_a": 0.0, "decode_b": 0.0, "decode_c": 0.0, "prefill_a": 0.0, "prefill_b": 0.0}
    prof = LinearProfile(**{**base, **coef})
    return float(run_rollout(lens.reshape(1, -1), np.repeat(prompt, group)[None], prof, group=group,
                             max_batch=max_batch).end[0])


def fit_decode(cfg, inputs, repeat: int, prefill: tuple[float, float], real: list[dict]) -> tuple[dict, dict]:
    p = 12
    grid = [(b, n) for b in (1, 8, 32, 64, 128, 256) for n in (24, 96)]
    X, y, rows = [], [], []
    for b, n in grid:
        t = time_decode(cfg, inputs, b, n, p, repeat)
        pre = prefill[0] + prefill[1] * (b // 8 or 1) * (p - 1)
        ctx = b * (n * p + n * (n - 1) / 2)
        X.append([n, b * n, ctx])
        y.append(t - pre)
        rows.append({"batch": b, "tokens": n, "seconds": round(t, 5)})
        print(f"decode B={b:<4} L={n:<4} {t:.4f}s ({t / n * 1e3:.3f} ms/iteration)", flush=True)
    G, mb = cfg.rollout.group_size, cfg.rollout.max_batch_size
    for r in real:
        pre = _basis(r["lens"], r["prompt"], G, mb, prefill_a=prefill[0], prefill_b=prefill[1])
        X.append([_basis(r["lens"], r["prompt"], G, mb, decode_a=1.0), _basis(r["lens"], r["prompt"], G, mb, decode_b=1.0),
                  _basis(r["lens"], r["prompt"], G, mb, decode_c=1.0)])
        y.append(r["seconds"] - pre)
    X, y = np.asarray(X, dtype=np.float64), np.asarray(y)
    n = len(grid)
    # Relative least squares on the grid (small runs count as much as big ones) gives the shape;
    # real rollouts, when there are any, give one scale on it (alone they cannot tell a from b:
    # every real step has about the same batch profile).
    w = 1.0 / y[:n]
    coef = _nnls(X[:n] * w[:, None], y[:n] * w)
    if real:
        coef = coef * float(np.median(y[n:] / (X[n:] @ coef)))
    pred = X @ coef
    err = float(np.max(np.abs(pred - y) / y))
    real_err = [round(float(e), 4) for e in ((pred - y) / y)[-len(real):]] if real else []
    rows.append({"real_rollout_rel_err": real_err})
    return ({"decode_a": float(coef[0]), "decode_b": float(coef[1]), "decode_c": float(coef[2])},
            {"decode_grid": rows, "decode_fit_max_rel_err": round(err, 4)})


def fit_spec(cfg, real_spec: list[dict], profile) -> tuple[dict, dict]:
    """``spec_request`` and ``spec_row``: real steps rolled out speculatively cost more than the
    decode fit says for their forwards and rows (drafting from the sources; verifying and
    accepting each draft token). Least squares of each step's excess on its target forwards
    (running requests' iterations) and draft tokens, over steps with few drafts (history, group
    and prompt sources) and with many (bubble drafts pre-generated: long, all accepted)."""
    from megarl.sim.rollout import run_rollout

    G, mb = cfg.rollout.group_size, cfg.rollout.max_batch_size
    X, y = [], []
    for r in real_spec:
        pred = float(run_rollout(r["lens"].reshape(1, -1), np.repeat(r["prompt"], G)[None], profile, group=G,
                                 max_batch=mb, fixed_tau=r["tau"], fixed_draft=r["draft"]).end[0])
        X.append([r["forwards"], r["forwards"] * r["draft"]])
        y.append(r["seconds"] - pred)
    req, row = _nnls(np.asarray(X, dtype=np.float64), np.asarray(y)) if X else (0.0, 0.0)
    print(f"speculation: {req * 1e6:.1f} us per request per iteration, {row * 1e6:.1f} us per draft token "
          f"beyond its row", flush=True)
    return {"spec_request": float(req), "spec_row": float(row)}, {
        "spec_real_steps": [{"seconds": round(r["seconds"], 4), "tau": round(r["tau"], 3), "draft": round(r["draft"], 3),
                             "excess_s": round(e, 4)} for r, e in zip(real_spec, y)]}


def _nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (active set: drop a negative one, refit)."""
    keep = np.ones(A.shape[1], dtype=bool)
    while True:
        c = np.zeros(A.shape[1])
        c[keep], *_ = np.linalg.lstsq(A[:, keep], b, rcond=None)
        if (c >= 0).all() or not keep.any():
            return np.maximum(c, 0.0)
        keep &= c > 0


def fit_prefill(cfg, inputs, repeat: int) -> tuple[float, float]:
    """Prompt caching cost a + b * tokens, from generate(max_new_tokens=1) at two prompt sizes
    (the one decode iteration is the same in both and cancels in b; a keeps it: conservative)."""
    pts = []
    for plen in (8, 64):
        pts.append((plen * 8, time_prefill(cfg, inputs, 64, plen, repeat)))  # 8 distinct prompts
    (x0, y0), (x1, y1) = pts
    b = max(0.0, (y1 - y0) / (x1 - x0))
    return max(0.0, y0 - b * x0) / 2, b  # half the fixed part: the other half is the decode row's iteration


def fit_trainer(cfg, inputs, repeat: int, real: list[dict]) -> tuple[dict, dict]:
    from megarl.parallel.dist import init_parallel, teardown
    from megarl.rl.grpo import UpdateSpec
    from megarl.stages.update import grpo_update
    from megarl.stream_train.stream import StreamUpdate
    from megarl.sim.hardware import LinearProfile
    from megarl.trainer.trainer import Trainer

    dims = init_parallel()
    try:
        trainer = Trainer(inputs.args, cfg.trainer, dims, seed=0, hf_dir=inputs.init_from_hf)
        mb = cfg.trainer.micro_batch_size
        rng = np.random.default_rng(0)
        batch = lambda n, w: probe.train_batch(rng, inputs.args.vocab_size, n, w)
        loss_fn = probe.tiny_loss

        fX, fy, bX, by, grid, full_rows = [], [], [], [], [], []
        for n, w in ((8, 32), (8, 96), (8, 192), (8, 320), (16, 64), (32, 128), (32, 256)):
            b = batch(n, w)
            trainer.begin_step()
            trainer.accumulate(b, loss_fn)  # warm-up
            tf = tb = np.inf
            for _ in range(repeat):
                t0 = time.perf_counter()
                trainer.masked_logprobs(b["input_ids"], b["loss_mask"])
                tf = min(tf, time.perf_counter() - t0)
                t0 = time.perf_counter()
                trainer.accumulate(b, loss_fn)
                tb = min(tb, time.perf_counter() - t0)
            k = -(-n // mb)
            fX.append([k, n * w, n * w * w]), fy.append(tf)
            bX.append([k, n * w, n * w * w]), by.append(tb)
            grid.append({"rows": n, "width": w, "forward_s": round(tf, 5), "fwd_bwd_s": round(tb, 5)})
            print(f"trainer rows={n:<3} width={w:<4} forward {tf:.4f}s  fwd+bwd {tb:.4f}s", flush=True)
        # Real steps: the plain update (grpo_update: old logprobs, forward/backward, optimizer) and
        # stream training (one accumulate per group, then the optimizer step) on real groups.
        zero = {"fwd_a": 0.0, "fwd_b": 0.0, "fwd_c": 0.0, "fwdbwd_a": 0.0, "fwdbwd_b": 0.0, "fwdbwd_c": 0.0, "micro_batch": mb}
        for r in real:
            seqs = (r["lens"] + r["prompt"][:, None]).ravel()
            t0 = time.perf_counter()
            grpo_update(trainer, r["groups"], UpdateSpec.of(cfg, inputs.tokenizer.pad_id))
            t_full = time.perf_counter() - t0
            stream = StreamUpdate(trainer, UpdateSpec.of(cfg, inputs.tokenizer.pad_id))
            stream.begin()
            t0 = time.perf_counter()
            for g in r["groups"]:
                stream.add_group(g)
            t_stream = time.perf_counter() - t0
            stream.finish(r["groups"])
            col = lambda k, st, x: LinearProfile(**{**zero, k: 1.0}).train_s(x, stream=st)
            fX.append([col("fwd_a", False, seqs), col("fwd_b", False, seqs), col("fwd_c", False, seqs)])
            # fwd+bwd is fitted on the stream timings; the plain step's forward part (its total
            # minus fwd+bwd and the optimizer step) is added to the forward fit below.
            bX.append([sum(col(k, True, (g_l + r["prompt"][i])) for i, g_l in enumerate(r["lens"]))
                       for k in ("fwdbwd_a", "fwdbwd_b", "fwdbwd_c")])
            by.append(t_stream)
            full_rows.append((seqs, t_full))
            grid.append({"real_step_s": round(t_full, 4), "real_stream_s": round(t_stream, 4),
                         "responses": int(r["lens"].size)})
            print(f"trainer real step: plain update {t_full:.3f}s, stream {t_stream:.3f}s", flush=True)
        t_fin = np.inf
        for _ in range(repeat):
            trainer.begin_step()
            trainer.accumulate(batch(8, 32), loss_fn)
            t0 = time.perf_counter()
            trainer.finish_step(scale=1e-3)
            t_fin = min(t_fin, time.perf_counter() - t0)
        eng = probe.make_engine(cfg, inputs, 8)
        t_sync = np.inf
        for _ in range(repeat):
            t0 = time.perf_counter()
            eng.load_weights(trainer.hf_state_dict())
            t_sync = min(t_sync, time.perf_counter() - t0)
    finally:
        teardown(dims)

    def lin(X, y, n_real):
        """Shape from the synthetic rows (relative least squares), scale from the real ones."""
        X, y = np.asarray(X, dtype=np.float64), np.asarray(y)
        k = len(y) - n_real
        c = _nnls(X[:k] / y[:k, None], np.ones(k))
        if n_real:
            c = c * float(np.median(y[k:] / (X[k:] @ c)))
        return c, float(np.max(np.abs(X @ c - y) / y))

    (ba, bb, bc), berr = lin(bX, by, len(full_rows))

    fb_prof = LinearProfile(fwd_a=0.0, fwd_b=0.0, fwd_c=0.0, fwdbwd_a=ba, fwdbwd_b=bb, fwdbwd_c=bc,
                            micro_batch=cfg.trainer.micro_batch_size)
    # Real plain steps: what is left after their fwd+bwd part (and the optimizer step) is the
    # old-logprob forward.
    for seqs, t_full in full_rows:
        fy.append(max(1e-6, t_full - fb_prof.train_s(seqs, stream=True) - t_fin))
    assert len(fy) == len(fX)
    (fa, fb, fc), ferr = lin(fX, fy, len(full_rows))
    return ({"fwd_a": float(fa), "fwd_b": float(fb), "fwd_c": float(fc), "fwdbwd_a": float(ba),
             "fwdbwd_b": float(bb), "fwdbwd_c": float(bc),
             "micro_batch": int(cfg.trainer.micro_batch_size), "finish_a": float(t_fin), "sync": float(t_sync)},
            {"trainer_grid": grid, "trainer_fit_max_rel_err": {"forward": round(ferr, 4), "fwd_bwd": round(berr, 4)}})


def overhead_per_response(cfg, inputs) -> float:
    """Host work per response per step outside engine and trainer: pickling a result for the
    replicas' exchange (all_gather_object) and back, and scoring it."""
    eng = probe.make_engine(cfg, inputs, 64)
    res = eng.generate(probe.decode_requests(64, 40, 12, inputs.args.vocab_size), step=0)
    t0 = time.perf_counter()
    for _ in range(5):
        pickle.loads(pickle.dumps(res))
    return (time.perf_counter() - t0) / 5 / len(res)


def contention(config: str, repeat: int, rounds: int) -> tuple[dict, dict, dict]:
    """``slowdown`` (decode loop) and ``train_slowdown`` (forward/backward passes): the time of
    one piece of work in 2 and in 4 processes at once over one process alone, the 4-process one
    over time-sharing too (4 / cores), each as the median of ``rounds`` ratios of alternating
    probes (megarl/sim/probe.py: workers started together, released together; alternating with
    the 1-process probe keeps the machine's drift out of the ratio). Returns the two dicts and
    the raw times for ``meta``."""
    cores = float(os.cpu_count() or 2)
    out, raw = {}, {}
    for kind in ("decode", "train"):
        fig = {"1": 1.0}
        with SpeedProbe(config, 1, kind, repeat) as p1:
            for n in (2, 4):
                with SpeedProbe(config, n, kind, repeat) as pn:
                    ratio, t1, tn = alternate(p1, pn, rounds)
                fig[str(n)] = round(max(1.0, ratio / max(1.0, n / cores)), 4)
                raw[f"{kind}_{n}"] = {"alone_s": [round(x, 4) for x in t1], "together_s": [round(x, 4) for x in tn]}
                print(f"contention ({kind}): {n} processes at once {ratio:.3f}x one alone "
                      f"(slowdown {fig[str(n)]:.3f} past time-sharing)", flush=True)
        out[kind] = fig
    return out["decode"], out["train"], {"contention_s": raw}


def fit_real_runs(config: str, from_hf: str, procs: list[int], steps: int, seed: int, profile,
                  ref: SpeedReference, speed: dict) -> tuple[dict, dict, dict]:
    """``slowdown`` and ``train_slowdown`` from real multi-process runs: for each process count,
    ``megarl train`` (torchrun, the plain synchronous baseline of ``megarl bench schedule``, another
    seed than the bench's: other prompts in another order) for ``steps`` steps, replayed through
    the simulator with ``profile`` (this calibration's one-process figures, no slowdown); the
    slowdown is measured over predicted, summed over the steps after the first: the generate
    phase for ``slowdown``, the training phase for ``train_slowdown``. It holds what a clean
    probe does not: the replicas' exchange over gloo, gradient all-reduce, the reward pool, the
    waiting processes' polling (the probes say 1.07-1.2x for 2 processes, real runs more).
    ``ref`` is timed right before and after each run and the one-process figures are scaled by
    its ratio to ``speed`` (the reference while they were timed): the factors are then what the
    processes cost each other, not also how much the machine drifted in between."""
    import dataclasses
    import tempfile

    from megarl.bench.schedule import COMMON, VARIANTS, launch_train
    from benchmarks.sim_replay import replay_run

    flat = dataclasses.replace(profile, slowdown={"1": 1.0}, train_slowdown=None, bubble_interference=1.0)
    slow, train_slow, raw = {"1": 1.0}, {"1": 1.0}, {}
    with tempfile.TemporaryDirectory(prefix="calibrate-sim-") as tmp:
        for n in procs:
            run = Path(tmp) / f"p{n}"
            before = ref.sample()
            launch_train(n, config, [*COMMON, *VARIANTS["baseline"], f"rl_steps={steps}", f"seed={seed}",
                                     f"model.init_from_hf={from_hf}"], run, Path(tmp) / f"p{n}.log")
            run_speed = ref.record(before, ref.sample())
            factor = speed_ratio(run_speed, speed)
            body = replay_run(run, n, flat.at_speed(factor))["steps"][1:]
            tot = {k: float(sum(r[k] for r in body)) for k in ("meas_gen_s", "pred_gen_s", "meas_train_s", "pred_train_s")}
            slow[str(n)] = round(max(1.0, tot["meas_gen_s"] / tot["pred_gen_s"]), 4)
            train_slow[str(n)] = round(max(1.0, tot["meas_train_s"] / tot["pred_train_s"]), 4)
            raw[str(n)] = {**{k: round(v, 4) for k, v in tot.items()}, "speed_factor": round(factor, 4),
                           "speed_ref": run_speed}
            print(f"real run on {n} processes ({len(body)} steps, machine {factor:.3f}x the one-process figures' "
                  f"time): generate {tot['meas_gen_s']:.2f}s measured / "
                  f"{tot['pred_gen_s']:.2f}s one-process figures -> slowdown {slow[str(n)]}; training "
                  f"{tot['meas_train_s']:.2f}s / {tot['pred_train_s']:.2f}s -> train_slowdown {train_slow[str(n)]}",
                  flush=True)
    return slow, train_slow, {"real_runs": {"steps": steps, "seed": seed, **raw}}


def idle_work_forever(config: str, kind: str) -> None:
    """A contention worker standing in for bubble work, at the priority megarl gives it
    (megarl/sched/bubble.py: the thread SCHED_IDLE, the process's scheduling group nice 19; it runs
    in its own session, as torchrun's workers do): the speed probe's forward/backward passes
    (``train``: stream or drafter training) or decoding (``decode``: pre-generation), until
    killed. Prints ``ready`` once it has warmed up (at normal priority) and lowered itself."""
    from megarl.sched.bubble import AutogroupNice, lower_thread_priority

    work, _ = probe.work_fn(config, kind)
    lower_thread_priority()
    AutogroupNice().__enter__()  # undone when the process is killed: the group is this process's own
    print("ready", flush=True)
    i = 1
    while True:
        work(i)
        i += 1


class _BesideIdleWork:
    """``probe`` measured beside 2 idle-priority workers (``idle_work_forever``) doing ``work``,
    started before each measurement and killed after it: the ``other`` of :func:`alternate`."""

    def __init__(self, probe_: SpeedProbe, config: str, work: str):
        self.probe, self.work = probe_, work
        self.cmd = [sys.executable, __file__, "--config", config, "--idle-work", work]

    def measure(self) -> float:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        idle = [subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
                for _ in range(2)]
        try:
            for p in idle:
                while (line := p.stdout.readline()) and line.strip() != "ready":
                    pass
                if not line:
                    raise RuntimeError(f"calibrate_sim: the idle-priority {self.work} worker exited ({p.wait()})")
            return self.probe.measure()
        finally:
            for p in idle:
                p.kill()
                p.wait()


def interference(config: str, repeat: int, rounds: int) -> tuple[dict, dict]:
    """``bubble_interference`` by kind of bubble work: the decode loop of 2 processes (the
    generating replicas) timed beside 2 idle-priority workers (``idle_work_forever``) over
    timed alone, alternately (alone, beside, alone, ...: ``rounds`` of each, the median ratio).
    Returns the profile's figures (>= 1) and the raw ones for ``meta``."""
    raw, ratios = {}, {}
    with SpeedProbe(config, 2, "decode", repeat) as p2:
        for kind, work in (("stream_train", "train"), ("pregen", "decode")):
            ratios[kind], alone, beside = alternate(p2, _BesideIdleWork(p2, config, work), rounds)
            raw[kind] = {"alone_s": [round(x, 4) for x in alone], "beside_s": [round(x, 4) for x in beside]}
    # Drafter training is forward/backward passes too (of a smaller model): the training figure.
    figures = {k: round(max(1.0, ratios[w]), 4) for k, w in (("stream_train", "stream_train"),
                                                              ("drafter_train", "stream_train"),
                                                              ("pregen", "pregen"))}
    print("interference: decode of 2 processes beside 2 idle-priority workers over alone: "
          + ", ".join(f"{k} {v:.3f}x" for k, v in ratios.items()), flush=True)
    return figures, {"interference_s": raw}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    ap.add_argument("--out", default=str(ROOT / "megarl" / "sim" / "profiles" / "cpu.json"))
    ap.add_argument("--repeat", type=int, default=3, help="timings per point (best kept)")
    ap.add_argument("--from-hf", default=None, help="trained policy (HF folder, e.g. a bench schedule work dir's "
                                                      "sft/hf): also fit on real rollouts and updates of it")
    ap.add_argument("--real-steps", type=int, default=6, help="real RL steps timed with --from-hf (default 6)")
    ap.add_argument("--real-procs", default="2,4",
                    help="with --from-hf: process counts of the real runs slowdown and train_slowdown are fitted on "
                         "(default 2,4; empty: the probes' figures)")
    ap.add_argument("--real-run-steps", type=int, default=8, help="steps of each real multi-process run (default 8)")
    ap.add_argument("--real-run-seed", type=int, default=4321,
                    help="seed of the real multi-process runs (default 4321: not the configs' 1234, so other prompts "
                         "than the runs being validated)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="alternating rounds per contention and interference ratio (median kept; default 5)")
    ap.add_argument("--speed-ref", type=int, default=5, metavar="N",
                    help="timings of the speed reference (megarl/sim/probe.py SpeedReference) at each of its points "
                         "(default 5)")
    ap.add_argument("--idle-work", choices=("train", "decode"), help=argparse.SUPPRESS)  # an interference worker
    args = ap.parse_args()
    if args.idle_work:
        idle_work_forever(args.config, args.idle_work)
        return
    from megarl.sim.hardware import LinearProfile
    from megarl.utils.fs import atomic_write_text

    load0 = os.getloadavg()
    # The machine's speed while the one-process figures are timed (before, between and after their
    # parts): bench runs record the same reference, and validate_sim scales this profile by the ratio.
    ref = SpeedReference(args.speed_ref)
    try:
        marks = [ref.sample()]
        cfg, inputs = probe.setup(args.config, args.from_hf)
        real = real_rollouts(cfg, inputs, args.real_steps) if args.from_hf else []
        real_spec = [*real_rollouts(cfg, inputs, args.real_steps, spec=True),
                     *real_rollouts(cfg, inputs, args.real_steps, spec=True, pregen=True)] if args.from_hf else []
        marks.append(ref.sample())
        pre = fit_prefill(cfg, inputs, args.repeat)
        dec, dec_meta = fit_decode(cfg, inputs, args.repeat, pre, real)
        spec_fit, spec_meta = fit_spec(cfg, real_spec, LinearProfile(**dec, prefill_a=pre[0], prefill_b=pre[1]))
        marks.append(ref.sample())
        tr, tr_meta = fit_trainer(cfg, inputs, args.repeat, real)
        ovh = overhead_per_response(cfg, inputs)
        marks.append(ref.sample())
        speed = ref.record(*marks)
        print(f"speed reference over the one-process figures: median {speed['median_s']:.4f}s "
              f"({min(min(m) for m in marks):.4f}-{max(max(m) for m in marks):.4f})", flush=True)
        slow, train_slow, cont_meta = contention(args.config, args.repeat, args.rounds)
        cont_meta = {**cont_meta, "probe_slowdown": slow, "probe_train_slowdown": train_slow}
        procs = [int(x) for x in args.real_procs.split(",") if x.strip()]
        if args.from_hf and procs:
            one = LinearProfile(**dec, **spec_fit, prefill_a=pre[0], prefill_b=pre[1], **tr, overhead_per_response=ovh,
                                cores=float(os.cpu_count() or 2))
            slow, train_slow, real_meta = fit_real_runs(args.config, args.from_hf, procs, args.real_run_steps,
                                                        args.real_run_seed, one, ref, speed)
            cont_meta.update(real_meta)
    finally:
        ref.close()
    inter, inter_meta = interference(args.config, args.repeat, args.rounds)
    cores = float(os.cpu_count() or 2)
    prof = LinearProfile(name="cpu", **dec, **spec_fit, prefill_a=pre[0], prefill_b=pre[1], **tr,
                         overhead_per_response=ovh,
                         cores=cores, slowdown=slow, train_slowdown=train_slow,
                         bubble_interference=inter,
                         meta={"config": os.path.relpath(args.config, ROOT), "cpu_count": os.cpu_count(),
                               "torch_threads": 1, "from_hf": args.from_hf, "real_steps": len(real), "date": time.strftime("%Y-%m-%d %H:%M"),
                               "loadavg_before": [round(x, 2) for x in load0],
                               "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                               "speed_ref": speed, **cont_meta, **inter_meta, **spec_meta,
                               **dec_meta, **tr_meta})
    atomic_write_text(args.out, prof.to_json() + "\n")
    print(json.dumps({k: v for k, v in json.loads(prof.to_json()).items() if k != "meta"}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
