"""Weight sync trainer -> engine: after every optimizer step the engine holds exactly the trainer's
weights (checksum), and a sync that delivers anything else is caught."""
import pytest
import torch

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.models.llama import CausalLM
from megarl.parallel.weight_sync import WeightSyncError, sync_weights, tensor_checksum
from megarl.stream_train.trainer import Trainer, TrainerConfig

from .test_trainer import make_batch, nll_loss


@pytest.mark.parametrize("tie", [False, True])
def test_checksum_equal_after_each_step(dims, make_args, tie):
    args = make_args("qwen2", tie=tie)
    trainer = Trainer(args, TrainerConfig(lr=1e-2, micro_batch_size=3), dims, seed=3)
    engine = Engine(CausalLM(args), EngineConfig(max_batch_size=4, max_seq_len=32), seed=0)
    batch = make_batch(args)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    outputs, checksums = [], []
    for _ in range(3):
        trainer.train_step(batch, nll_loss)
        info = sync_weights(trainer, engine)
        # the engine's weights, read back, are bit for bit the trainer's
        assert tensor_checksum(engine.model.state_dict()) == tensor_checksum(trainer.hf_state_dict())
        assert info["weight_checksum"] == tensor_checksum(trainer.hf_state_dict())[:16]
        assert info["weight_sync_bytes"] == sum(t.numel() * 4 for t in trainer.hf_state_dict().values())
        checksums.append(info["weight_checksum"])
        outputs.append(engine.generate([Request(uid=0, sample_idx=0, prompt_ids=[3, 4, 5], params=params)],
                                       step=0)[0].tokens)
    assert len(set(checksums)) == 3, "weights did not change between steps"
    # and the engine computes with them: its logits equal a fresh model loaded from the trainer
    ref = CausalLM(args)
    ref.load_state_dict(trainer.hf_state_dict())
    ids = batch["input_ids"][:2]
    with torch.no_grad():
        assert torch.equal(engine.model(ids), ref(ids))


def test_checksum_sees_any_change():
    sd = {"a": torch.zeros(3, 2), "b": torch.ones(4)}
    base = tensor_checksum(sd)
    changed = {"a": sd["a"].clone(), "b": sd["b"]}
    changed["a"][1, 0] = torch.finfo(torch.float32).tiny  # one subnormal-ish bit pattern
    assert tensor_checksum(changed) != base
    assert tensor_checksum({"a": sd["a"].reshape(2, 3), "b": sd["b"]}) != base  # shape is hashed
    assert tensor_checksum({"a": sd["a"].double(), "b": sd["b"]}) != base  # dtype is hashed
    assert tensor_checksum({"b": sd["b"], "a": sd["a"]}) == base  # order of insertion is not


def test_corrupted_sync_is_caught(dims, make_args, monkeypatch):
    args = make_args("qwen2")
    trainer = Trainer(args, TrainerConfig(lr=1e-2), dims, seed=3)
    engine = Engine(CausalLM(args), EngineConfig(max_batch_size=2, max_seq_len=32), seed=0)
    original = engine.load_weights

    def lossy_load(named):  # a transport that flips one value
        named = dict(named)
        w = named["model.norm.weight"].clone()
        w[0] += 1e-3
        named["model.norm.weight"] = w
        original(named)

    monkeypatch.setattr(engine, "load_weights", lossy_load)
    with pytest.raises(WeightSyncError, match="differ"):
        sync_weights(trainer, engine)
