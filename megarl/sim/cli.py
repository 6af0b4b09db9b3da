"""``megarl simulate``: the cluster simulator on the command line.

    megarl simulate --preset A --gpus 128 --json OUT [--plot PNG] [--sweep 8,16,...,8192] [--seed S]

writes ``{"baseline": {step_time_s, rollout_share, tail_share, bubble_frac}, "megarl": {same},
"speedup": float, "features": {combination: speedup}}`` (plus ``"sweep"``: one row per GPU count
with the baseline's and megarl's figures, when sweeping) and prints a table. Bad input names the
flag (``megarl: error: --gpus=0 is invalid; ...``). Calibrating the ``cpu`` profile is
``benchmarks/calibrate_sim.py``; checking it against measured runs, ``benchmarks/validate_sim.py``.
"""
from __future__ import annotations

import argparse
import json

from megarl.sim.config import SimConfig
from megarl.sim.lengths import PRESETS
from megarl.sim.run import format_table, parse_sweep, report, write_plot
from megarl.sim.step import StepKnobs
from megarl.utils.fs import atomic_write_text


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="discrete-event simulation of synchronous RL steps on N GPUs: "
                                               "step time, bubbles, speedup of each megarl feature")
    p.add_argument("--preset", default="A", help=f"response-length preset: {sorted(PRESETS)} (default A)")
    p.add_argument("--gpus", type=int, default=128, help="GPUs (default 128)")
    p.add_argument("--gpus-per-replica", type=int, default=1, help="rollout tensor-parallel size (default 1)")
    p.add_argument("--profile", default="h100", help="device profile: h100, cpu, or a profile .json (default h100)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the preset's, scaled "
                                                             "with --gpus)")
    p.add_argument("--steps", type=int, default=3, help="steps per combination; the first only warms up (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream-balance", default="own", help="stream-training leftovers: own (megarl) or pooled")
    p.add_argument("--sweep", default=None, metavar="G1,G2,...", help="also baseline vs megarl at these GPU counts, "
                                                                     "e.g. 8,16,...,8192")
    p.add_argument("--json", required=True, help="where to write the figures")
    p.add_argument("--plot", default=None, help="also draw them into this PNG")
    return p


def run_simulate(args: argparse.Namespace) -> int:
    sweep = parse_sweep(args.sweep) if args.sweep else None
    cfg = SimConfig(preset=args.preset, gpus=args.gpus, gpus_per_replica=args.gpus_per_replica,
                    profile=args.profile, prompts=args.prompts, steps=args.steps, seed=args.seed,
                    knobs=StepKnobs(stream_balance=args.stream_balance))
    cfg.make_profile()  # a bad --profile fails before any work
    for g in sweep or []:
        if g % cfg.gpus_per_replica:
            raise ValueError(f"--sweep: {g} GPUs is not divisible by --gpus-per-replica={cfg.gpus_per_replica}")
    rep = report(cfg, sweep, progress=True)
    atomic_write_text(args.json, json.dumps(rep, indent=2) + "\n")
    if args.plot:
        write_plot(rep, args.plot, f"preset {cfg.preset}, {cfg.gpus} GPUs ({cfg.profile}), "
                                   f"{cfg.step_prompts()} prompts x {cfg.knobs.group}")
    print(format_table(rep))
    return 0
