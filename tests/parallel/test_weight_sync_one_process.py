"""Weight sync trainer -> engine in one process (TP=PP=EP=1: the same plan and code as the
multi-process layouts of tests/parallel/test_weight_sync.py, without collectives): after every
optimizer step the engine holds exactly the trainer's weights, the checksum is the one every
layout reports for those weights, and a sync that delivers anything else is caught."""
import pytest
import torch

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.models.init_weights import init_hf_state
from megarl.models.llama import CausalLM
from megarl.parallel import weight_sync
from megarl.parallel.checksum import tensor_checksum, weight_checksum
from megarl.parallel.weight_sync import WeightSync, WeightSyncError
from megarl.trainer.trainer import Trainer, TrainerConfig
from tests.parallel.weight_sync_worker import BUCKET_MB, DENSE, MOE, SEED, case_args

from tests.trainer.test_trainer import make_batch, nll_loss


@pytest.mark.parametrize("tie", [False, True])
def test_checksum_equal_after_each_step(dims, make_args, tie):
    args = make_args("qwen2", tie=tie)
    trainer = Trainer(args, TrainerConfig(lr=1e-2, micro_batch_size=3), dims, seed=3)
    engine = Engine(CausalLM(args), EngineConfig(max_batch_size=4, max_seq_len=32), seed=0)
    sync = WeightSync(trainer, engine)
    batch = make_batch(args)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    outputs, checksums = [], []
    for _ in range(3):
        trainer.train_step(batch, nll_loss)
        info = sync()
        hf = trainer.hf_state_dict()
        # the engine's weights, read back, are bit for bit the trainer's
        assert tensor_checksum(engine.model.state_dict()) == tensor_checksum(hf)
        assert info["weight_checksum"] == weight_checksum(hf, args)
        assert info["weight_sync_bytes"] == sum(t.numel() * 4 for t in hf.values())
        assert info["weight_sync_buckets"] == 1 and info["weight_sync_wire_bytes"] == 0  # 64 MB, no hops
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


@pytest.mark.parametrize("case", DENSE + MOE)
def test_single_process_checksum_is_the_layouts(dims, case):
    """The multi-process layouts report ``weight_checksum`` of these weights; so does one process,
    in small buckets too, into a float64 and a float32 engine."""
    args = case_args(*case)
    hf = init_hf_state(args, SEED, torch.float64)
    trainer = Trainer(args, TrainerConfig(dtype="float64"), dims, hf_state=hf)
    for dtype in ("float64", "float32"):
        engine = Engine(CausalLM(args), EngineConfig(max_batch_size=2, max_seq_len=16, dtype=dtype), seed=0)
        info = WeightSync(trainer, engine, bucket_mb=BUCKET_MB)()
        assert info["weight_checksum"] == weight_checksum(hf, args) and info["weight_sync_buckets"] >= 4
        assert info["weight_sync_peak_bytes"] <= BUCKET_MB * 2 ** 20
        sd = engine.model.state_dict()
        assert all(torch.equal(sd[k], hf[k].to(sd[k].dtype)) for k in sd)


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
    original = weight_sync._copy_to_engine
    norm = engine.model.model.norm.weight

    def lossy_copy(dst, src):  # a transport that flips one value
        original(dst, src)
        if dst.data_ptr() == norm.data_ptr():
            dst[0] += 1e-3

    sync = WeightSync(trainer, engine)
    monkeypatch.setattr(weight_sync, "_copy_to_engine", lossy_copy)
    with pytest.raises(WeightSyncError, match=r"rank 0: bucket 0: engine tensor model\.norm\.weight"):
        sync()
    monkeypatch.setattr(weight_sync, "_copy_to_engine", original)
    sync()  # and the run's next sync repairs it


def test_mismatched_engine_is_refused(dims, make_args):
    trainer = Trainer(make_args("qwen2"), TrainerConfig(), dims, seed=3)
    engine = Engine(CausalLM(make_args("llama")), EngineConfig(max_batch_size=2, max_seq_len=32), seed=0)
    with pytest.raises(ValueError, match="missing in engine: model.layers.0.self_attn.k_proj.bias"):
        WeightSync(trainer, engine)
    with pytest.raises(ValueError, match="bucket_mb=0"):
        WeightSync(trainer, engine, bucket_mb=0)
