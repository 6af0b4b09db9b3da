"""Response-length distributions of one RL step: the presets and replays of megarl's own runs.

A step draws P prompts x G samples. Lengths are heavy-tailed in two ways that matter for
scheduling (docs/design.md §6): *prompt-level* spread (some prompts are simply harder: all their
samples are long, which is what length-aware placement predicts from history) and *runaway*
prompts (a few percent whose samples loop until the length cap: the stragglers).

Model, per prompt p and sample s::

    m_p      = median * exp(N(0, sigma_prompt))            prompt difficulty
    len_ps   = m_p * exp(N(0, sigma_sample))                sibling spread
    runaway  : with probability runaway_frac per prompt, each of its samples independently
               (runaway_share) becomes max_len * min(1, U(runaway_low, 1.1)); the part above 1
               is truncation at the cap (such samples end with finish_reason "length")
    clipped to [1, max_len]

Preset A (RollPacker-like, 16k cap) gives a median near 600, P75 near 0.95k and a max of the
cap (max/median ~27); preset B (long CoT, 64k cap, Seer/Moonlight-like) a mean near 22k.
``tests/sim/test_lengths.py`` checks the stated ranges on fresh draws.

:class:`ReplayLengths` replays the response lengths a megarl run recorded (``timeline.jsonl``'s
``response_lengths``, or ``rollouts.jsonl``'s samples), step by step, so the CPU runs can be
simulated with the lengths they really produced.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class LengthPreset:
    """A parametric response-length distribution (see the module docstring for the model)."""

    name: str
    """Preset key (``--preset``)."""
    max_len: int
    """Length cap (max_new_tokens): runaway samples end here."""
    median: float
    """Median response length of an ordinary prompt's sample."""
    sigma_prompt: float
    """Log-std of the per-prompt median (prompt difficulty)."""
    sigma_sample: float
    """Log-std of a sample around its prompt's median (sibling spread)."""
    runaway_frac: float
    """Share of prompts that run away."""
    runaway_share: float
    """Share of a runaway prompt's samples that run away."""
    runaway_low: float
    """Lower end, as a share of ``max_len``, of a runaway sample's length."""
    prompt_len: int
    """Prompt tokens (prefill, and context carried through decoding)."""
    prompts: int
    """Prompts per step (P) at ``ref_gpus`` GPUs."""
    group: int
    """Samples per prompt (G)."""
    ref_gpus: int
    """GPU count at which a step has ``prompts`` prompts; the simulator scales P with the GPU
    count (weak scaling: the same responses per GPU), see megarl/sim/config.py."""


PRESETS = {
    # 128 prompts x 8 per 16 H100s: 64 responses per GPU, the density at which decode is batched
    # like production runs (DAPO-style 512x16 on 128 GPUs is the same density).
    "A": LengthPreset("A", max_len=16384, median=600.0, sigma_prompt=0.5, sigma_sample=0.45,
                      runaway_frac=0.04, runaway_share=0.75, runaway_low=0.5, prompt_len=200,
                      prompts=128, group=8, ref_gpus=16),
    # Long CoT: 16 responses per GPU (KV of a 64k sequence of a 7B model is ~3.7 GB).
    "B": LengthPreset("B", max_len=65536, median=18500.0, sigma_prompt=0.45, sigma_sample=0.3,
                      runaway_frac=0.06, runaway_share=0.6, runaway_low=0.6, prompt_len=300,
                      prompts=64, group=16, ref_gpus=64),
}


@dataclass
class StepLengths:
    """One step's draw: ``lengths[p, s]`` response tokens, ``prompt_len[p]`` prompt tokens and
    ``expected[p]`` the prompt's expected length (what a perfect history would predict)."""

    lengths: np.ndarray
    prompt_len: np.ndarray
    expected: np.ndarray

    @property
    def prompts(self) -> int:
        return self.lengths.shape[0]


def draw(preset: LengthPreset, prompts: int, rng: np.random.Generator) -> StepLengths:
    """``prompts`` prompts x ``preset.group`` samples from ``preset``."""
    g = preset.group
    m = preset.median * np.exp(rng.normal(0.0, preset.sigma_prompt, prompts))
    lens = m[:, None] * np.exp(rng.normal(0.0, preset.sigma_sample, (prompts, g)))
    run = rng.random(prompts) < preset.runaway_frac
    run_s = run[:, None] & (rng.random((prompts, g)) < preset.runaway_share)
    run_len = preset.max_len * np.minimum(1.0, rng.uniform(preset.runaway_low, 1.1, (prompts, g)))
    lens = np.where(run_s, run_len, lens)
    lens = np.clip(np.rint(lens), 1, preset.max_len).astype(np.int64)
    # What a prompt's history would predict: its mean over a fresh draw of its samples (the
    # lognormal mean for ordinary prompts, the runaway mix for runaway ones).
    ordinary = np.minimum(m * np.exp(preset.sigma_sample ** 2 / 2), preset.max_len)
    runaway_mean = preset.max_len * (1.0 - (1.0 - preset.runaway_low) / 2 * 0.8)  # ~ E[min(1, U(low, 1.1))]
    expected = np.where(run, preset.runaway_share * runaway_mean + (1 - preset.runaway_share) * ordinary, ordinary)
    return StepLengths(lens, np.full(prompts, preset.prompt_len, dtype=np.int64), expected)


def stats(lengths: np.ndarray) -> dict[str, float]:
    """Summary figures of a set of response lengths."""
    x = np.asarray(lengths, dtype=np.float64).ravel()
    med = float(np.median(x))
    return {"median": med, "mean": float(x.mean()), "p75": float(np.percentile(x, 75)),
            "p90": float(np.percentile(x, 90)), "max": float(x.max()), "max_over_median": float(x.max() / med)}


class ReplayLengths:
    """Per-step response lengths recorded by a megarl run, as ``[P, G]`` arrays in step order.

    ``timeline.jsonl`` lists every response of a step in prompt order (G consecutive samples per
    prompt); ``rollouts.jsonl`` lists every sample with its ``uid``, grouped the same way. Either
    works; the uids (from ``rollouts.jsonl``) let length-aware placement use real history."""

    def __init__(self, path: str | Path, group: int, prompt_len: int = 12):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--lengths: no such file: {path}")
        self.steps: list[StepLengths] = []
        self.uids: list[np.ndarray] = []
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if "response_lengths" in row:
                lens, uids = np.asarray(row["response_lengths"], dtype=np.int64), None
            elif "samples" in row:
                lens = np.asarray([len(s["tokens"]) for s in row["samples"]], dtype=np.int64)
                uids = np.asarray([s["uid"] for s in row["samples"]][::group], dtype=np.int64)
            else:
                raise ValueError(f"--lengths: {path} line {len(self.steps) + 1} has neither response_lengths "
                                 f"(timeline.jsonl) nor samples (rollouts.jsonl)")
            if lens.size == 0 or lens.size % group:
                raise ValueError(f"--lengths: step {row.get('step')} of {path} has {lens.size} responses, not a "
                                 f"multiple of the group size {group}")
            lens = np.maximum(lens.reshape(-1, group), 1)
            self.steps.append(StepLengths(lens, np.full(lens.shape[0], prompt_len, dtype=np.int64),
                                          lens.mean(axis=1)))
            self.uids.append(uids if uids is not None else np.arange(lens.shape[0]))
        if not self.steps:
            raise ValueError(f"--lengths: {path} holds no steps")

    def step(self, i: int) -> StepLengths:
        return self.steps[i % len(self.steps)]


def noisy_prediction(expected: np.ndarray, rng: np.random.Generator, sigma: float, coverage: float = 1.0
                     ) -> np.ndarray:
    """What megarl's length history (megarl/sched/placement.py ``LengthHistory``) would predict:
    ``expected`` with log-normal noise for the ``coverage`` share of prompts seen before; the
    mean of the seen predictions for the rest."""
    pred = np.asarray(expected, dtype=np.float64) * np.exp(rng.normal(0.0, sigma, len(expected)))
    seen = rng.random(len(expected)) < coverage
    if not seen.any():
        return np.ones(len(expected))
    return np.where(seen, pred, pred[seen].mean())
