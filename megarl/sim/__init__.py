"""Cluster simulator (``megarl simulate``, issue 8): a discrete-event model of synchronous RL
steps on N rollout replicas and trainers, for scales that cannot be run here.

lengths.py (response-length presets, replays), hardware.py (cost profiles: calibrated CPU,
first-principles H100), spec.py (acceptance per draft source), placement.py, rollout.py (the
engines, as an event-driven fluid), share.py (processes sharing CPU cores), step.py (one step
with every feature), run.py (combinations, sweeps, plot), config.py, cli.py, replay.py (measured
runs replayed, for validation).
"""
