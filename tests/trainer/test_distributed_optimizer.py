"""``trainer.distributed_optimizer``: Megatron's DistributedOptimizer (ZeRO-1) over DP=2 on gloo
ends at the weights of the plain optimizer (fp32, rounding level), resumes bitwise from a
checkpoint whose optimizer state is sharded per DP rank, and holds half the optimizer bytes."""
from pathlib import Path

import pytest
import torch

from megarl.checkpoint.rl_state import load_checkpoint, optimizer_shard_file
from megarl.config import load_config
from megarl.trainer.trainer import Trainer, TrainerConfig
from megarl.resume import RunDirError, check_run_dir

from tests.torchrun import torchrun
from .test_trainer import make_batch, nll_loss

WORKER = Path(__file__).parent / "dist_opt_worker.py"


@pytest.fixture(scope="module")
def fp32_dp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_opt")
    torchrun(WORKER, 2, str(out), "float32")
    return out, torch.load(out / "result.pt")


@pytest.mark.multiproc
def test_sharded_bf16_optimizer(tmp_path):
    """bf16 with fp32 master shards: the plain run's weights but for a few roundings,
    a bitwise resume, half the optimizer bytes (master shards and moments), bf16 in the engine."""
    torchrun(WORKER, 2, str(tmp_path), "bfloat16")
    res = torch.load(tmp_path / "result.pt")
    w1, w2, w3 = res[False]["weights"], res[True]["weights"], res["resumed"]["weights"]
    assert all(w2[k].dtype == torch.bfloat16 for k in w2)
    differ = sum(int((w1[k] != w2[k]).sum()) for k in w1)
    assert differ <= 0.01 * sum(w.numel() for w in w1.values()), differ  # measured: 38 of 20000
    # most differ by one bf16 ulp; where Adam's step on a tiny gradient turns with the rounding
    # (measured: one bias), by up to 4e-4, against updates of up to 4e-2 (4 steps at lr 1e-2)
    assert max((w1[k].float() - w2[k].float()).abs().max().item() for k in w1) <= 1e-3
    assert all(torch.equal(w3[k], w2[k]) for k in w2)
    plain, sharded = res[False]["opt_bytes"], res[True]["opt_bytes"]
    assert sum(sharded) == plain[0] and max(sharded) <= 0.51 * plain[0], (plain, sharded)
    assert len(set(res["engine_checksums"])) == 1


@pytest.mark.multiproc
def test_sharded_optimizer_ends_at_the_plain_weights(fp32_dp2):
    _, res = fp32_dp2
    plain, sharded = res[False], res[True]
    for m1, m2 in zip(plain["metrics"], sharded["metrics"]):
        assert m1["loss"] == m2["loss"]  # the forward is the same until the weights differ by rounding
        assert abs(m1["grad_norm"] - m2["grad_norm"]) < 1e-6 * m1["grad_norm"]
    w1, w2 = plain["weights"], sharded["weights"]
    # 4 Adam steps at lr 1e-2 move weights by ~4e-2; the norm's summation order differs (shards), so the
    # clip factor differs in the last bits: rounding level, three orders below the update
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 2e-5


@pytest.mark.multiproc
def test_sharded_optimizer_resumes_bitwise(fp32_dp2):
    out, res = fp32_dp2
    want, got = res[True]["weights"], res["resumed"]["weights"]
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert len(set(res["engine_checksums"])) == 1  # both ranks' engines hold the trainer's weights
    ckpt = out / "run" / "checkpoints" / "step_000002"
    assert (ckpt / optimizer_shard_file(0, 0, 1)).exists()  # DP rank 1's shard, in its own file


@pytest.mark.multiproc
def test_sharded_optimizer_halves_the_optimizer_bytes(fp32_dp2):
    _, res = fp32_dp2
    plain, sharded = res[False]["opt_bytes"], res[True]["opt_bytes"]
    assert plain[0] == plain[1] > 0
    # each rank holds Adam's two fp32 moments of its half of the parameters (the split follows the
    # buckets' padded ranges, so the halves differ by a few elements) and together they hold it all
    assert sum(sharded) == plain[0], (plain, sharded)
    assert max(sharded) <= 0.51 * plain[0], (plain, sharded)


@pytest.mark.multiproc
def test_resume_at_another_dp_size_is_refused(fp32_dp2, dims, make_args):
    out, _ = fp32_dp2
    state, _ = load_checkpoint(out / "run" / "checkpoints" / "step_000002")
    tr = Trainer(make_args("qwen2", tie=True), TrainerConfig(micro_batch_size=2, distributed_optimizer=True), dims)
    with pytest.raises(ValueError, match="data-parallel size it was saved with"):
        tr.load_state_dict(state)
    plain = Trainer(make_args("qwen2", tie=True), TrainerConfig(micro_batch_size=2), dims)
    with pytest.raises(ValueError, match="resume with trainer.distributed_optimizer=True"):
        plain.load_state_dict(state)
    # and `megarl train --resume` refuses both before it loads anything (this process: a world of one)
    for overrides, match in ((["trainer.distributed_optimizer=true"], "data-parallel size is 1: resume with 2"),
                             ([], "written with trainer.distributed_optimizer=True")):
        with pytest.raises(RunDirError, match=match):
            # the worker's run dir has no config.yaml to compare with: the layout check is the subject here
            check_run_dir(out / "run", True, load_config(None, overrides), allow_config_change=True)


def test_fp64_is_refused():
    with pytest.raises(ValueError, match="distributed_optimizer"):
        TrainerConfig(dtype="float64", distributed_optimizer=True)


def test_fresh_sharded_optimizer_checkpoints(dims, make_args):
    """A checkpoint taken before the first step (after SFT's optimizer reset) resumes as fresh."""
    args = make_args("qwen2")
    cfg = TrainerConfig(lr=1e-2, micro_batch_size=2, distributed_optimizer=True)
    batch = make_batch(args)
    run = Trainer(args, cfg, dims, seed=5)
    ckpt = run.state_dict()
    run.train_step(batch, nll_loss)
    resumed = Trainer(args, cfg, dims, seed=6)
    resumed.load_state_dict(ckpt)
    resumed.train_step(batch, nll_loss)
    want, got = run.hf_state_dict(), resumed.hf_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
