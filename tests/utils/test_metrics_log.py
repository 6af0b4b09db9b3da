"""megarl.utils.metrics_log: metrics.jsonl, TensorBoard scalars read back with TensorBoard's own
reader (equal to the jsonl values, one point per step after a resume), W&B offline runs."""
from __future__ import annotations

import glob
import struct
import time

import numpy as np
import pytest

from megarl.utils import metrics_log
from megarl.utils.dataclass_config import ConfigError, from_dict
from megarl.utils.jsonl import read_lines, truncate_to_step
from megarl.utils.metrics_log import LoggingConfig, MetricsLogger, scalar_tag

pytest.importorskip("tensorboard")


def _metrics(step: int, scale: float = 1.0) -> dict:
    """A metrics.jsonl line's kinds of values: floats, ints, a bool-ish float, a string, '/' keys."""
    return {"loss": 0.25 * step * scale, "grad_norm": 1.0 / (step + 3) * scale, "update_ok": 1.0,
            "weight_checksum": f"{step:016x}", "step": step, "reward_mean": 0.1 * step * scale,
            "reward_max": 1.0, "entropy_mean": 2.7 - 0.1 * step, "response_len_mean": 14.375 * scale,
            "response_len_max": 49 + step, "rollout_tokens": 230 * step, "rollout_time_s": 0.0977 * scale,
            "bubble_time_s": 6.79e-06, "train_time_s": 0.0397, "weight_sync_s": 0.0034, "bubble_frac": 0.001,
            "spec/group/accept_rate": 0.5 + 0.01 * step, "some_new_metric": 3, "notes": None}


def _scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _assert_tb_matches_jsonl(run_dir):
    scalars = _scalars(run_dir / "tensorboard")
    lines = read_lines(run_dir / "metrics.jsonl")
    numeric = {scalar_tag(k) for line in lines for k, v in line.items() if k != "step" and isinstance(v, (int, float))}
    assert set(scalars) == numeric  # strings and None have no scalar
    for tag, points in scalars.items():
        steps = [s for s, _ in points]
        assert steps == sorted(set(steps)), f"{tag}: duplicate or unordered steps {steps}"
    for line in lines:
        for k, v in line.items():
            if k != "step" and isinstance(v, (int, float)):
                got = dict(scalars[scalar_tag(k)])[line["step"]]
                assert got == np.float32(v), (k, line["step"], got, v)  # stored as float32


def test_scalar_tags():
    assert scalar_tag("reward_mean") == "rollout/reward_mean"
    assert scalar_tag("response_len_p50") == "rollout/response_len_p50"
    assert scalar_tag("rollout_time_s") == "time/rollout_time_s"
    assert scalar_tag("weight_sync_s") == "time/weight_sync_s"
    assert scalar_tag("weight_sync_gbps") == "sync/weight_sync_gbps"
    assert scalar_tag("grad_norm") == "train/grad_norm"
    assert scalar_tag("bubble_frac") == "sched/bubble_frac"
    assert scalar_tag("spec/group/accept_rate") == "spec/group/accept_rate"
    assert scalar_tag("some_new_metric") == "misc/some_new_metric"


def test_tensorboard_scalars_equal_jsonl(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run, LoggingConfig(), config_dict={"seed": 7, "rollout": {"group_size": 4}}) as m:
        for s in (1, 2, 3):
            m.log(s, _metrics(s))
    assert [line["step"] for line in read_lines(run / "metrics.jsonl")] == [1, 2, 3]
    assert read_lines(run / "metrics.jsonl")[0]["weight_checksum"] == "0000000000000001"  # jsonl keeps strings
    _assert_tb_matches_jsonl(run)
    assert len(_scalars(run / "tensorboard")["rollout/reward_mean"]) == 3


def test_resume_purges_rerun_steps(tmp_path):
    """Steps 3-4 ran, the run died, resumed from the checkpoint of step 2 and ran 3-5 again (with
    other timings): TensorBoard shows one point per step, the re-run's."""
    run = tmp_path / "run"
    with MetricsLogger(run, LoggingConfig()) as m:
        for s in (1, 2, 3, 4):
            m.log(s, _metrics(s))
    truncate_to_step(run / "metrics.jsonl", 2)  # what resume does before logging again
    with MetricsLogger(run, LoggingConfig(), resume_step=2) as m:
        for s in (3, 4, 5):
            m.log(s, _metrics(s, scale=2.0))
    scalars = _scalars(run / "tensorboard")
    assert [s for s, _ in scalars["rollout/reward_mean"]] == [1, 2, 3, 4, 5]
    assert dict(scalars["rollout/reward_mean"])[4] == np.float32(0.1 * 4 * 2.0)
    _assert_tb_matches_jsonl(run)


def test_disabled_writes_nothing(tmp_path):
    m = MetricsLogger(tmp_path / "run", LoggingConfig(tensorboard=True), enabled=False)
    m.log(1, _metrics(1))
    m.close()
    assert not (tmp_path / "run").exists()


def test_tensorboard_off_and_step_mismatch(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run, LoggingConfig(tensorboard=False)) as m:
        m.log(1, {"reward_mean": 0.5})
        with pytest.raises(ValueError, match=r"metrics\['step'\]=2 differs from step=3"):
            m.log(3, {"step": 2})
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_config_validation():
    with pytest.raises(ValueError, match=r"logging\.wandb_mode='cloud' is invalid; valid choices: \['online', 'offline'\]"):
        LoggingConfig(wandb_project="p", wandb_mode="cloud")
    with pytest.raises(ValueError, match=r"logging\.tensorboard='yes' is invalid"):
        LoggingConfig(tensorboard="yes")
    with pytest.raises(ValueError, match=r"logging\.wandb_project='' is invalid"):
        LoggingConfig(wandb_project="")
    with pytest.raises(ValueError, match="logging.wandb_project is not"):
        LoggingConfig(wandb_mode="offline")
    cfg = from_dict(LoggingConfig, {"tensorboard": False, "wandb_project": "p", "wandb_mode": "offline"})
    assert cfg == LoggingConfig(tensorboard=False, wandb_project="p", wandb_mode="offline")
    with pytest.raises(ConfigError, match="wandb_mode"):
        from_dict(LoggingConfig, {"wandb_project": "p", "wandb_mode": "cloud"})


def test_missing_packages_named_at_construction(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics_log, "_installed", lambda name: False)
    assert LoggingConfig().use_tensorboard is False  # auto: off without the package
    with pytest.raises(ValueError, match="pip install wandb"):
        MetricsLogger(tmp_path / "a", LoggingConfig(wandb_project="p", wandb_mode="offline"))
    with pytest.raises(ValueError, match="pip install tensorboard"):
        MetricsLogger(tmp_path / "b", LoggingConfig(tensorboard=True))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---------------------------------------------------------------------------------------- W&B


def _wandb_records(path) -> list:
    """The records of a ``.wandb`` file (W&B's LevelDB-style log: a 7-byte header, then 32 KiB
    blocks of chunks, each ``crc32 u32, length u16, type u8`` then data; 1 = whole, 2-4 =
    first/middle/last piece of a record)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, buf, records = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            records.append(rec)
            buf = b""
    return records


def _finished_records(path, timeout_s: float = 30.0) -> list:
    """The records once W&B's service has written the run's last (``exit``) record: ``finish()``
    returns before its writer has flushed the file."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var, sub in (("WANDB_CONFIG_DIR", "cfg"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return LoggingConfig(tensorboard=False, wandb_project="megarl-test", wandb_mode="offline", run_name="t")


def test_wandb_offline_run_under_run_dir(tmp_path, wandb_offline):
    import json

    run = tmp_path / "run"
    with MetricsLogger(run, wandb_offline, config_dict={"seed": 7}) as m:
        for s in (1, 2):
            m.log(s, _metrics(s))
    files = glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    records = _finished_records(files[0])
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in records
               if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [1, 2]
    for h, s in zip(history, (1, 2)):
        expected = {scalar_tag(k): float(v) for k, v in _metrics(s).items()
                    if k != "step" and isinstance(v, (int, float))}
        assert {k: v for k, v in h.items() if not k.startswith("_")} == expected
    run_rec = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run_rec.project == "megarl-test" and run_rec.display_name == "t"
    assert {i.key: json.loads(i.value_json) for i in run_rec.config.update}["seed"] == 7

    run_id = (run / "wandb" / "megarl_run_id").read_text().strip()
    time.sleep(1 - time.time() % 1)  # W&B names run folders by the second: a real resume comes later
    with MetricsLogger(run, wandb_offline, resume_step=1) as m:  # resumes the same W&B run
        m.log(2, _metrics(2))
    assert len(glob.glob(str(run / "wandb" / f"offline-run-*-{run_id}"))) == 2
