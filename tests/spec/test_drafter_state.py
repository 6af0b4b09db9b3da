"""The drafter's share of an RL checkpoint (megarl/spec/drafter_state.py): saved with
``save_checkpoint`` and restored into a fresh engine, the drafter continues bit for bit as the
original does (weights, Adam state, training batches, buffer), the bandit makes the same choices
given the same rewards, and the speculator's acceptance rates come back. Whole runs: test_drafter_runs.py."""
import logging

import pytest
import torch

from megarl.checkpoint.rl_state import save_checkpoint
from megarl.spec.bandit import ARMS
from megarl.spec.drafter_state import drafter_files, file_name, restore_drafter
from megarl.spec.drafter_train import HiddenBuffer
from tests.spec.test_drafter import _drafter_engine, _requests, _target


def _trained_engine(seed=0, **kw):
    eng = _drafter_engine(_target(), strategy="bandit", sources=("group",), max_batch_size=8, seed=seed, **kw)
    eng.generate(_requests(range(3), max_new=24), step=0)  # fills the buffer, the bandit and the acceptance rates
    eng.spec.drafter.trainer.train(max_steps=4)
    return eng


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_restored_drafter_continues_bit_for_bit(tmp_path):
    a = _trained_engine()
    ckpt = save_checkpoint(tmp_path, 1, {}, {}, rank_files=drafter_files(a.spec, replica=0))
    assert (ckpt / file_name(0)).is_file()
    # fresh (its batch seed, spec.drafter.seed, must be the same: it is config, not state)
    b = _drafter_engine(_target(), strategy="bandit", sources=("group",), max_batch_size=8)
    assert restore_drafter(b, ckpt, replica=0, step=1) == 4
    sa, sb = a.spec, b.spec
    assert torch.equal(_flat(sa.drafter.model), _flat(sb.drafter.model))
    assert sb._accept == sa._accept and sa._accept  # the rates the cost rule reads
    ra, rb = sa.drafter.buffer.records, sb.drafter.buffer.records
    assert len(ra) == len(rb) > 0 and sb.drafter.buffer.tokens == sa.drafter.buffer.tokens
    for (fa, ta, pa), (fb, tb, pb) in zip(ra, rb):
        assert torch.equal(fa, fb) and torch.equal(ta, tb) and pa == pb and fb.dtype == torch.float64
    # the next training steps: same batches (seeded by the step count), same Adam moments
    la = sa.drafter.trainer.train(max_steps=3)["drafter_loss"]
    lb = sb.drafter.trainer.train(max_steps=3)["drafter_loss"]
    assert la == lb and torch.equal(_flat(sa.drafter.model), _flat(sb.drafter.model))
    # the bandit: same statistics, so the same choices given the same rewards (buckets met before and new ones)
    assert sb.bandit.state_dict() == sa.bandit.state_dict()
    for t in range(40):
        rows = (1, 3, 6, 40)[t % 4]
        arm = sa.bandit.choose(rows)
        assert sb.bandit.choose(rows) == arm
        reward = 100.0 + 10 * ARMS.index(arm) + t % 7
        sa.bandit.update(rows, arm, reward)
        sb.bandit.update(rows, arm, reward)
    assert sb.bandit.state_dict() == sa.bandit.state_dict()


def test_buffer_reload_keeps_the_newest_records_a_smaller_buffer_holds():
    buf = HiddenBuffer(1000)
    for i in range(5):
        buf.add(torch.full((30 + i, 4), float(i)), torch.arange(30 + i), 2)
    small = HiddenBuffer(100)
    small.load_state_dict(buf.state_dict(), dtype=torch.float32)
    assert [int(f[0, 0]) for f, _, _ in small.records] == [2, 3, 4] and small.tokens == 32 + 33 + 34
    assert all(f.dtype == torch.float32 and r == 2 for f, _, r in small.records)
    empty = HiddenBuffer(10)
    empty.load_state_dict(HiddenBuffer(10).state_dict())
    assert len(empty) == 0 and empty.tokens == 0


def test_restore_with_other_replica_counts_and_without_drafter_state(tmp_path, caplog):
    a, b = _trained_engine(seed=0), _trained_engine(seed=1)
    ckpt = save_checkpoint(tmp_path, 2, {}, {}, rank_files={**drafter_files(a.spec, 0), **drafter_files(b.spec, 1)})
    fresh = _drafter_engine(_target(), strategy="bandit", sources=("group",), max_batch_size=8)
    with caplog.at_level(logging.WARNING):
        restore_drafter(fresh, ckpt, replica=3, step=2)  # 4 replicas now, 2 saved: replica 3 takes replica 1's
    assert torch.equal(fresh.spec.drafter.buffer.records[0][0], b.spec.drafter.buffer.records[0][0])
    assert "replica 3 resumes from replica 1's" in caplog.text
    other = _drafter_engine(_target(), strategy="drafter", max_batch_size=8)  # no bandit: its state is not needed
    restore_drafter(other, ckpt, replica=1, step=2)
    assert torch.equal(_flat(other.spec.drafter.model), _flat(b.spec.drafter.model))
    (ckpt / file_name(0)).unlink()
    with pytest.raises(ValueError, match=r"replicas \[1\]"):
        restore_drafter(fresh, ckpt, replica=0, step=2)
    bare = save_checkpoint(tmp_path, 3, {}, {})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert restore_drafter(fresh, bare, replica=0, step=3) == 0
    assert "holds no drafter state" in caplog.text
