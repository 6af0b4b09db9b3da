"""RL checkpoints: checksums verified on read, a corrupted checkpoint named
with the previous good one, old checkpoints still loading, orphaned temporaries removed."""
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megarl.checkpoint import rl_state
from megarl.checkpoint.rl_state import (CheckpointCorrupted, latest_checkpoint, list_checkpoints, load_checkpoint,
                                        remove_orphaned_temporaries, save_checkpoint, verify_checkpoint)
from megarl.utils.run_lock import RunLock

REPO = Path(__file__).resolve().parents[2]


def _trainer_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": [{"w": torch.randn(64, 32, generator=g)}],
            "optimizer": {"step": step, "m": torch.randn(64, generator=g)}}


def _save(run_dir: Path, step: int, **kw) -> Path:
    return save_checkpoint(run_dir, step, _trainer_state(step), {"cursor": step * 10}, keep=5,
                           ref_state={"w": torch.ones(8) * step}, rank_files={"drafter_replica0.pt": {"n": step}}, **kw)


@pytest.fixture
def run_dir(tmp_path) -> Path:
    for step in (1, 2, 3):
        _save(tmp_path, step)
    return tmp_path


def test_checksums_of_every_file_are_recorded_and_loading_round_trips(run_dir):
    ckpt = latest_checkpoint(run_dir)
    state = json.loads((ckpt / "state.json").read_text())
    files = state["checksums"]["files"]
    assert state["checksums"]["algorithm"] == "sha256"
    assert sorted(files) == ["drafter_replica0.pt", "ref.pt", "trainer.pt"]
    assert all(files[n]["bytes"] == (ckpt / n).stat().st_size and len(files[n]["sha256"]) == 64 for n in files)
    trainer_state, loop_state = load_checkpoint(ckpt)
    assert loop_state == {"step": 3, "cursor": 30}   # no checksum fields leak into the loop state
    assert torch.equal(trainer_state["model"][0]["w"], _trainer_state(3)["model"][0]["w"])
    assert torch.equal(trainer_state["ref"]["w"], torch.ones(8) * 3)


def test_truncated_file_names_it_and_the_previous_good_step(run_dir):
    trainer = run_dir / "checkpoints" / "step_000003" / "trainer.pt"
    trainer.write_bytes(trainer.read_bytes()[:100])
    for call in (lambda: latest_checkpoint(run_dir), lambda: load_checkpoint(run_dir / "checkpoints" / "step_000003")):
        with pytest.raises(CheckpointCorrupted) as info:
            call()
        msg = str(info.value)
        assert "step_000003 is corrupted: trainer.pt has 100 bytes" in msg
        assert "the previous good checkpoint is step_000002" in msg
        assert info.value.previous == run_dir / "checkpoints" / "step_000002"


def test_deleted_file_names_it_and_skips_corrupted_earlier_ones(run_dir):
    (run_dir / "checkpoints" / "step_000003" / "ref.pt").unlink()
    (run_dir / "checkpoints" / "step_000002" / "drafter_replica0.pt").unlink()
    with pytest.raises(CheckpointCorrupted, match="step_000003 is corrupted: ref.pt is missing; the previous good "
                                                  "checkpoint is step_000001"):
        latest_checkpoint(run_dir)


def test_skip_corrupted_is_explicit(run_dir, caplog):
    (run_dir / "checkpoints" / "step_000003" / "trainer.pt").unlink()
    with caplog.at_level(logging.WARNING, logger="megarl.checkpoint.rl_state"):
        assert latest_checkpoint(run_dir, skip_corrupted=True) == run_dir / "checkpoints" / "step_000002"
    assert "skipping corrupted checkpoint" in caplog.text and "step_000003" in caplog.text


def test_flipped_bytes_of_the_same_size_fail_on_load(run_dir):
    ckpt = run_dir / "checkpoints" / "step_000003"
    data = bytearray((ckpt / "trainer.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ckpt / "trainer.pt").write_bytes(bytes(data))
    assert latest_checkpoint(run_dir) == ckpt   # sizes agree: only the hash can tell
    with pytest.raises(CheckpointCorrupted, match="trainer.pt does not match the sha256 checksum.*previous good "
                                                  "checkpoint is step_000002"):
        load_checkpoint(ckpt)
    verify_checkpoint(ckpt, read=["ref.pt"])   # each process hashes only what it reads


def test_edited_state_json_fails_its_own_checksum(run_dir):
    path = run_dir / "checkpoints" / "step_000003" / "state.json"
    path.write_text(path.read_text().replace('"cursor": 30', '"cursor": 31'))
    with pytest.raises(CheckpointCorrupted, match="state.json does not match its own checksum"):
        load_checkpoint(path.parent)
    path.write_text("{torn")
    with pytest.raises(CheckpointCorrupted, match="state.json is not valid JSON"):
        latest_checkpoint(run_dir)


def test_only_checkpoint_corrupted_says_so(tmp_path):
    ckpt = _save(tmp_path, 0)
    (ckpt / "trainer.pt").unlink()
    with pytest.raises(CheckpointCorrupted, match="no earlier checkpoint is intact") as info:
        latest_checkpoint(tmp_path)
    assert info.value.previous is None
    assert issubclass(CheckpointCorrupted, ValueError)   # the CLI: one line, exit 2


def test_checkpoint_without_checksums_still_loads_with_a_warning(run_dir, caplog):
    ckpt = run_dir / "checkpoints" / "step_000003"
    state = json.loads((ckpt / "state.json").read_text())
    del state["checksums"], state["state_sha256"]
    (ckpt / "state.json").write_text(json.dumps(state))
    with caplog.at_level(logging.WARNING, logger="megarl.checkpoint.rl_state"):
        trainer_state, loop_state = load_checkpoint(latest_checkpoint(run_dir))
    assert loop_state["cursor"] == 30 and "no checksums" in caplog.text and "unverified" in caplog.text
    (ckpt / "trainer.pt").unlink()   # without checksums the trainer file is still required
    with pytest.raises(CheckpointCorrupted, match="trainer.pt is missing; the previous good checkpoint is step_000002"):
        latest_checkpoint(run_dir)


def test_multi_process_write_gathers_every_writers_checksums(tmp_path, monkeypatch):
    """Two trainer processes (tp=2), played by threads with a thread barrier for dist.barrier:
    each hashes its own file into a sidecar; rank 0 folds them into state.json."""
    barrier = threading.Barrier(2)
    monkeypatch.setattr(rl_state.dist, "barrier", lambda *a, **k: barrier.wait(timeout=30))

    def dims(rank):
        return SimpleNamespace(tp=2, pp=1, vpp=1, world_size=2, rank=rank, trains=True, dp_rank=0, tp_rank=rank,
                               pp_rank=0)

    errors = []

    def write(rank):
        try:
            save_checkpoint(tmp_path, 4, _trainer_state(rank), {"cursor": 1}, dims=dims(rank),
                            ref_state={"w": torch.zeros(2)} if rank == 0 else None,
                            rank_files={f"drafter_replica{rank}.pt": {"r": rank}})
        except BaseException as e:   # surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=write, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    ckpt = tmp_path / "checkpoints" / "step_000004"
    files = json.loads((ckpt / "state.json").read_text())["checksums"]["files"]
    assert sorted(files) == ["drafter_replica0.pt", "drafter_replica1.pt", "ref.pt", "trainer_tp0_pp0.pt",
                             "trainer_tp1_pp0.pt"]
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([*files, "state.json"])   # no sidecar left
    state, _ = load_checkpoint(ckpt, dims(1))
    assert torch.equal(state["model"][0]["w"], _trainer_state(1)["model"][0]["w"])
    (ckpt / "trainer_tp1_pp0.pt").write_bytes(b"x" * files["trainer_tp1_pp0.pt"]["bytes"])
    load_checkpoint(ckpt, dims(0))   # rank 0 does not read rank 1's file
    with pytest.raises(CheckpointCorrupted, match="trainer_tp1_pp0.pt does not match"):
        load_checkpoint(ckpt, dims(1))


# ----------------------------------------------------------------------------------------------
# orphaned temporaries

INTERRUPTED_WRITE = """
import sys, time
from pathlib import Path
from megarl.utils.fs import atomic_dir
with atomic_dir(Path(sys.argv[1]) / "checkpoints" / "step_000007") as tmp:
    (tmp / "trainer.pt").write_bytes(b"half")
    print("writing", flush=True)
    time.sleep(60)
"""


def test_interrupted_write_leaves_a_temporary_that_the_next_start_removes(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED_WRITE, str(run_dir)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline() == "writing\n"
    proc.send_signal(signal.SIGKILL)   # kill -9 during the checkpoint write
    proc.wait()
    leftovers = list((run_dir / "checkpoints").glob(".step_000007.tmp-*"))
    assert len(leftovers) == 1
    with RunLock(run_dir) as lock:
        assert remove_orphaned_temporaries(run_dir, lock) == leftovers
    assert not leftovers[0].exists()
    assert [s for s, _ in list_checkpoints(run_dir)] == [1, 2, 3]


def test_orphans_of_every_atomic_writer_are_removed_and_an_old_copy_restored(run_dir):
    ckpts = run_dir / "checkpoints"
    made = [ckpts / ".step_000004.tmp-k2j4", ckpts / ".step_000005.tmp", run_dir / ".hf.pieces",
            run_dir / ".hf.tmp-1x2y", ckpts / ".step_000003.old-4242"]
    for d in made:
        d.mkdir()
        (d / "trainer.pt").write_bytes(b"partial")
    (run_dir / ".config.yaml.tmp-abc").write_text("half")
    made.append(run_dir / ".config.yaml.tmp-abc")
    os.rename(ckpts / "step_000002", ckpts / ".step_000002.old-4242")   # crash between atomic_dir's renames
    (run_dir / "notes.txt").write_text("mine")
    with RunLock(run_dir) as lock:
        removed = remove_orphaned_temporaries(run_dir, lock)
    assert sorted(removed) == sorted(made) and not any(p.exists() for p in made)
    assert [s for s, _ in list_checkpoints(run_dir)] == [1, 2, 3]   # step 2 restored, step 3 kept
    load_checkpoint(ckpts / "step_000002")
    assert (run_dir / "notes.txt").exists() and (run_dir / ".lock").exists()


def test_removing_orphans_requires_the_run_lock(run_dir, tmp_path):
    (run_dir / "checkpoints" / ".step_000004.tmp-k2j4").mkdir()
    with pytest.raises(ValueError, match="needs that run directory's lock held"):
        remove_orphaned_temporaries(run_dir, RunLock(run_dir))
    with RunLock(tmp_path / "other") as other, pytest.raises(ValueError, match="lock held"):
        remove_orphaned_temporaries(run_dir, other)
    assert (run_dir / "checkpoints" / ".step_000004.tmp-k2j4").exists()


def test_generating_only_process_checks_sizes_without_a_trainer_rank(run_dir):
    """A rank that only generates (disaggregated placement) has no tp_rank: it must not ask."""
    class GenerateOnly(SimpleNamespace):
        @property
        def tp_rank(self):
            raise RuntimeError("rank 3 only generates")

    dims = GenerateOnly(tp=1, pp=1, vpp=1, trains=False)
    assert load_checkpoint(run_dir / "checkpoints" / "step_000003", dims) == ({}, {"step": 3, "cursor": 30})
    (run_dir / "checkpoints" / "step_000003" / "trainer.pt").unlink()
    with pytest.raises(CheckpointCorrupted, match="trainer.pt is missing"):
        load_checkpoint(run_dir / "checkpoints" / "step_000003", dims)
