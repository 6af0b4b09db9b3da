"""Cluster simulator (``megarl simulate``): a discrete-event model of synchronous RL steps on N
rollout replicas and trainers, for scales that cannot be run here.

lengths.py (response-length presets, replays, the length predictor's noise), hardware.py (cost
profiles: calibrated CPU, first-principles H100), spec.py (acceptance per draft source),
rollout.py (the engines, as an event-driven fluid), share.py (processes sharing CPU cores),
step.py (one step with every feature; placement is megarl/sched/placement.py's own algorithm),
run.py (combinations, sweeps, plot), config.py, cli.py. Replaying measured runs through it, to
validate it, is a developer tool: benchmarks/sim_replay.py (benchmarks/validate_sim.py).
"""
