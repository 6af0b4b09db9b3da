"""The KL reference sharded like the policy (megarl/trainer/reference.py): at TP=2 each rank
holds about half the reference weights that the whole plain-torch copy took, and its logprobs are
those of that copy (fp64: rounding level), the policy untouched by its forward."""
from pathlib import Path

import pytest
import torch

from tests.torchrun import torchrun

WORKER = Path(__file__).parent / "reference_worker.py"


@pytest.mark.multiproc
def test_sharded_reference_at_tp2(tmp_path):
    torchrun(WORKER, 2, str(tmp_path), "2")
    res = torch.load(tmp_path / "result.pt")
    sharded, plain, policy = res["sharded"], res["plain"], res["policy"]
    scored = plain != 0
    assert (sharded.abs() > 0).sum() == scored.sum()
    # an fp32 ulp or two at |logprob| ~5.5 (the plain path rounds the logits to fp32 before the
    # softmax, the trainer's after it, in fp64; measured 4.8e-7); the policy 2 steps on: ~0.4
    assert (sharded - plain).abs().max().item() <= 1e-6
    assert (policy - plain).abs().max().item() > 1e-3
    assert res["policy_unchanged"] and res["ref_state_equal"] and res["resumed_equal"]
    # layer norms are replicated over TP, everything else split in two
    assert all(0.45 * res["full_bytes"] < b < 0.55 * res["full_bytes"] for b in res["ref_bytes"]), res
