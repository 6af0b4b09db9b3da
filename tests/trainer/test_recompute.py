"""``trainer.recompute``: Megatron's activation recompute changes no weight beyond rounding and
keeps fewer activations for the backward."""
import pytest
import torch

from megarl.trainer.trainer import Trainer, TrainerConfig

from .test_trainer import cpu_fp64_trainer, make_batch, nll_loss


def trained(args, dims, recompute, dtype, steps=3):
    tr = Trainer(args, TrainerConfig(lr=1e-2, micro_batch_size=4, dtype=dtype, recompute=recompute), dims, seed=3)
    for s in range(steps):
        tr.train_step(make_batch(args, seed=s), nll_loss)
    return tr.hf_state_dict()


@cpu_fp64_trainer
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_changes_no_weight(dims, make_args, recompute):
    args = make_args("qwen2", tie=True)
    for dtype, tol in (("float64", 1e-12), ("float32", 1e-6)):
        want, got = trained(args, dims, "none", dtype), trained(args, dims, recompute, dtype)
        assert max((got[k] - want[k]).abs().max().item() for k in want) <= tol, (dtype, recompute)


def saved_activation_bytes(tr, batch) -> int:
    """Bytes of the tensors autograd keeps for the backward at the end of the forward (one
    micro-batch: the schedule runs its forward, then its backward): every tensor saved before the
    first one is read back, each storage once; the weights (saved by the linears) excluded."""
    weights = {p.untyped_storage().data_ptr() for p in tr.gpt.parameters()}
    seen, state = set(), {"backward": False, "bytes": 0}

    def pack(t):
        storage = t.untyped_storage()
        if not state["backward"] and storage.data_ptr() not in weights | seen:
            seen.add(storage.data_ptr())
            state["bytes"] += storage.nbytes()
        return t

    def unpack(t):
        state["backward"] = True
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        tr.train_step(batch, nll_loss)
    return state["bytes"]


def test_recompute_keeps_fewer_activations(dims, make_args):
    args = make_args("qwen2", num_hidden_layers=4, intermediate_size=128)
    batch = make_batch(args)
    kept = {r: saved_activation_bytes(Trainer(args, TrainerConfig(micro_batch_size=8, recompute=r), dims, seed=3),
                                      batch) for r in ("none", "selective", "full")}
    assert kept["full"] < kept["selective"] < kept["none"], kept


def test_recompute_is_checked():
    with pytest.raises(ValueError, match="recompute"):
        TrainerConfig(recompute="some")
