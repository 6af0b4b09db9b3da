"""Whole GRPO runs with the learned drafter, through tests/parallel_run_worker.py's tiny
fp64 runs (drafter_run_worker.py adds a per-step record of each process's drafter):

- resume: a one-process run with speculation, the drafter (bandit strategy) and its training,
  stopped after step 2 and resumed from the checkpoint, repeats the uninterrupted run: the same
  samples and metrics (bandit choices and rewards included), the same drafter weights after every
  step, the same exported drafter and policy, bit for bit;
- two processes (two rollout replicas) training the drafter in their bubbles: after every step the
  replicas' drafters are bitwise identical, the samples are those of the run with speculation off,
  and the drafter trained (its weights moved, its loss on a fixed batch fell below the fresh init's).
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.train import TIME_KEYS
from tests.torchrun import torchrun

WORKER = Path(__file__).with_name("drafter_run_worker.py")
BASE = "rl_steps=3,rollout.max_new_tokens=24,rollout.dump=true"
# Speculation with the group source and the drafter; drafter training in bubbles (a one-replica
# run has none: it takes spec.drafter.steps_after_rollout steps after each rollout instead). No
# cost rule: it would keep a barely trained drafter from drafting at these batch sizes.
DRAFTER = (BASE + ",spec.enabled=true,spec.sources=[group],spec.drafter.enabled=true,spec.forward_cost_tokens=0,"
           "schedule.bubble_work=[drafter_train],schedule.bubble_priority=normal")
SINGLE = {"plain": BASE, "bandit": DRAFTER + ",spec.drafter.strategy=bandit",
          "bandit_resumed": DRAFTER + ",spec.drafter.strategy=bandit,resume_at=2"}
DP2 = {"dp2": DRAFTER}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter_runs")
    torchrun(WORKER, 1, str(out), *(f"{k}={v}" for k, v in SINGLE.items()))
    torchrun(WORKER, 2, str(out), *(f"{k}={v}" for k, v in DP2.items()))
    return out


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _samples(run_dir: Path) -> list[list[tuple]]:
    return [[(s["uid"], s["sample_idx"], s["tokens"]) for s in line["samples"]]
            for line in _jsonl(run_dir / "rollouts.jsonl")]


@pytest.mark.multiproc
def test_resumed_drafter_run_repeats_the_uninterrupted_run(runs):
    full, resumed = runs / "bandit", runs / "bandit_resumed"
    # the checkpoint the resumed run started from holds the drafter's state
    assert (resumed / "checkpoints" / "step_000002" / "drafter_replica0.pt").is_file()
    assert _samples(full) == _samples(resumed) == _samples(runs / "plain")  # and they are the exact samples
    want, got = _jsonl(full / "metrics.jsonl"), _jsonl(resumed / "metrics.jsonl")
    assert [m["step"] for m in got] == [1, 2, 3]
    for w, g in zip(want, got):
        # everything but the timings, the bandit's choices and rewards (spec_strategy/*) included; in one
        # process the drafter's training steps and loss do not depend on timing either
        assert {k: v for k, v in g.items() if k not in TIME_KEYS} == {k: v for k, v in w.items() if k not in TIME_KEYS}
        assert (g["drafter_train_steps"], g["drafter_loss"]) == (w["drafter_train_steps"], w["drafter_loss"])
    assert any(k.startswith("spec_strategy/") for k in want[-1])  # the bandit chose (and was compared) in step 3
    assert want[-1]["spec/drafter/drafted"] > 0  # the restored drafter drafted in the resumed step
    # the drafter after every step (weights, training steps, buffer), and what the runs exported
    assert _jsonl(full / "drafter_rank0.jsonl") == _jsonl(resumed / "drafter_rank0.jsonl")
    for name in ("drafter/model.safetensors", "model.safetensors"):
        a, b = load_file(full / "hf" / name), load_file(resumed / "hf" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.multiproc
def test_two_replicas_train_the_drafter_in_bubbles_identically_and_exactly(runs):
    run = runs / "dp2"
    ranks = [_jsonl(run / f"drafter_rank{r}.jsonl") for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 3
    for step, (a, b) in enumerate(zip(*ranks), 1):
        assert a["digest"] == b["digest"], f"replicas' drafters differ after step {step}"
    # each replica trains on its own rollouts; the steps it takes depend on its bubbles' length
    assert sum(r[-1]["train_steps"] for r in ranks) > 0, "no drafter training step in any bubble"
    assert ranks[0][-1]["digest"] != ranks[0][-1]["digest_init"]  # the weights moved
    for r in ranks:  # trained vs. fresh init, same batch, same target (embedding and head) at the last step
        assert r[-1]["loss_fixed_batch"] < r[-1]["loss_fixed_batch_init"]
    assert _samples(run) == _samples(runs / "plain")  # exact: the samples of speculation off
    metrics = _jsonl(run / "metrics.jsonl")
    assert sum(m["spec/drafter/accepted"] for m in metrics) > 0  # the drafter's drafts were used
    assert all(m["target_forwards"] < m["rollout_tokens"] for m in metrics)
