"""Helpers for the tests that run the real ``megarl`` CLI in subprocesses (tests/test_e2e.py,
tests/test_faults.py): Megatron's parallel state is per process, so every run is its own process."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOKE = "configs/smoke.yaml"


def cli_env(**extra: str) -> dict:
    """The environment of a CLI subprocess: this checkout's ``megarl`` first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGARL_FAULT", "MEGARL_FAULT_DIR",
              "MEGARL_FAULT_RANK"):
        env.pop(k, None)
    return {**env, **extra}


def megarl(*args, check=True, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", *args], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"megarl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def deterministic_part(m: dict) -> dict:
    """A metrics line without its timings: what a repeated or resumed run must reproduce."""
    from megarl.train import TIME_KEYS

    return {k: v for k, v in m.items() if k not in TIME_KEYS}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_weights_change_every_step(metrics: list[dict]) -> None:
    """Every step of ``metrics`` updated the policy: a nonzero gradient and a new weight checksum
    (a run whose steps change nothing makes every resume comparison vacuous)."""
    sums = [m["weight_checksum"] for m in metrics]
    assert all(m["grad_norm"] > 0 for m in metrics), [(m["step"], m["grad_norm"]) for m in metrics]
    assert len(set(sums)) == len(sums), f"a step left the weights unchanged: {sums}"


def copy_run_until(src: Path, dst: Path, step: int) -> Path:
    """``dst``: ``src`` as a run interrupted right after its checkpoint of ``step`` (the later
    checkpoints, the export and the TensorBoard files left out; metrics.jsonl and timeline.jsonl
    kept whole: a resume cuts them back itself)."""
    dst.mkdir(parents=True)
    for name in ("config.yaml", "sft.json") + (("metrics.jsonl", "timeline.jsonl") if step > 0 else ()):
        shutil.copy2(src / name, dst / name)
    (dst / "checkpoints").mkdir()
    for ck in sorted((src / "checkpoints").iterdir()):
        if int(ck.name.removeprefix("step_")) <= step:
            shutil.copytree(ck, dst / "checkpoints" / ck.name)
    return dst


def assert_same_as(run_dir: Path, ref: Path) -> None:
    """``run_dir`` ended as the uninterrupted ``ref``: the same metrics (timings aside), the same
    timeline steps, bitwise the same exported weights, and no temporaries left behind."""
    got, want = read_metrics(run_dir), read_metrics(ref)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(got, want):
        assert deterministic_part(a) == deterministic_part(b), a["step"]
    timeline = [json.loads(ln)["step"] for ln in (run_dir / "timeline.jsonl").read_text().splitlines()]
    assert timeline == [m["step"] for m in want]
    assert (run_dir / "hf" / "model.safetensors").read_bytes() == (ref / "hf" / "model.safetensors").read_bytes(), \
        "the final weights differ from the uninterrupted run's"
    left = [p for p in run_dir.rglob(".*") if p.name != ".lock"]
    assert not left, f"temporaries left behind: {left}"
