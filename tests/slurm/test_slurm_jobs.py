"""The Slurm scripts on a real single-node Slurm (session fixture ``slurm``, tests/slurm/conftest.py).

- A: ``sbatch scripts/slurm/train_cpu.sbatch``, 2 srun tasks on gloo (ranks from Slurm's
  environment, megarl/parallel/launch_env.py): the job completes, both ranks took part in every
  step, metrics.jsonl has every step with finite losses.
- B: the same run, signalled like ``#SBATCH --signal=B:USR1@<s>`` does before a time limit
  (``scancel --batch --signal=USR1``): the ranks checkpoint after their current step and exit 75,
  the script requeues the job, the job runs again (same id) and resumes from the checkpoint, and
  ends with A's final weights (bitwise: deterministic CPU run, same reductions).
- ``megarl convert`` as two dependent batch jobs (convert.sbatch): HF -> Megatron TP=2 -> HF
  gives A's export back bitwise.

The run: configs/smoke.yaml with an easy task (two terms up to 4) after 30 SFT steps, so that
GRPO groups have mixed rewards and every step really updates the weights; 8 RL steps.
"""
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.parallel.launch_env import expand_hostlist
from megarl.parallel.preempt import RECORD_NAME
from tests.slurm.cluster import FINISHED

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "slurm"
STEPS = 8
ARGS = ("--set", f"rl_steps={STEPS}", "--set", "sft.steps=30", "--set", "checkpoint_every=0",
        "--set", "task.max_terms=2", "--set", "task.max_operand=4", "--set", "task.strategy_weights=[1,0,0]",
        "--set", "rollout.max_new_tokens=24", "--set", "rollout.group_size=8")

# convert.sbatch asks for a real machine's memory and CPUs; the test node declares 1000 MB.
SMALL = ("--mem=500M", "--cpus-per-task=1")


def job_env(slurm, run_dir: Path) -> dict:
    """What the submitting shell would export: where megarl and the run are."""
    env = {**slurm.env, "MEGARL_HOME": str(ROOT), "PYTHON": sys.executable, "RUN_DIR": str(run_dir),
           "CONFIG": str(ROOT / "configs" / "smoke.yaml"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # none from the test process
        env.pop(k, None)
    return env


def submit_train(slurm, run_dir: Path) -> int:
    return slurm.sbatch(SCRIPTS / "train_cpu.sbatch", *ARGS, env=job_env(slurm, run_dir), cwd=run_dir.parent,
                        options=(f"--output={run_dir}.out",))


def batch_log(run_dir: Path) -> str:
    """The batch script's log, then the tail of every rank's log (a failure message names the cause)."""
    p = Path(f"{run_dir}.out")
    out = p.read_text() if p.exists() else "(no batch log)"
    for log in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []:
        out += f"\n--- {log.name} (last lines)\n" + "\n".join(log.read_text().splitlines()[-15:])
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def hf_weights(run_dir: Path) -> dict:
    return load_file(run_dir / "hf" / "model.safetensors")


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def plain_run(slurm, tmp_path_factory):
    """Test A's job (also B's reference): submitted and waited for."""
    run_dir = tmp_path_factory.mktemp("slurm_runs") / "plain"
    job_id = submit_train(slurm, run_dir)
    job = slurm.wait(job_id)
    return run_dir, job


def test_hostlist_parser_matches_scontrol(slurm):
    """launch_env's parser expands host lists as Slurm itself does."""
    for hostlist in ("node[01-03,7],gpu5", "r[1-2]n[08-10]", "a1,b[9-11]", slurm.host):
        proc = slurm.run("scontrol", "show", "hostnames", hostlist)
        assert proc.returncode == 0, proc.stderr
        assert expand_hostlist(hostlist) == proc.stdout.split(), hostlist


def test_train_job_runs_two_ranks_to_the_end(slurm, plain_run):
    run_dir, job = plain_run
    assert (job.state, job.exit_code, job.restarts) == ("COMPLETED", "0:0", 0), batch_log(run_dir)
    assert [c["JobState"] for c in slurm.completions(job.id)] == ["COMPLETED"]
    got = metrics(run_dir)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in got)
    assert sum(m["grad_norm"] > 0 for m in got) >= STEPS - 1  # real updates, not all-equal rewards
    # both srun tasks joined one world of 2 (ranks from SLURM_PROCID / SLURM_STEP_NUM_TASKS)
    timeline = [json.loads(x) for x in (run_dir / "timeline.jsonl").read_text().splitlines()]
    assert all([r["rank"] for r in t["ranks"]] == [0, 1] for t in timeline)
    logs = sorted(p.name for p in (run_dir / "logs").iterdir())
    assert logs == [f"{job.id}_r0_0.log", f"{job.id}_r0_1.log"]  # one log per rank
    # logging was set up knowing the world (the rank tag appears only in worlds of more than one)
    assert "[rank0] megarl INFO SFT done" in (run_dir / "logs" / f"{job.id}_r0_0.log").read_text()
    assert (run_dir / "hf" / "model.safetensors").exists()


def test_signalled_job_checkpoints_requeues_and_resumes_to_the_same_weights(slurm, plain_run, tmp_path):
    ref_dir, _ = plain_run
    run_dir = tmp_path / "preempted"
    job_id = submit_train(slurm, run_dir)
    # Signal once the run is inside the training loop's reach (SFT done: handlers installed, RL
    # steps ahead), as Slurm does --signal=B:USR1@<s> before the time limit.
    slurm.wait(job_id, until=lambda j: (run_dir / "sft.json").exists() or j.state not in ("PENDING", "RUNNING"),
               timeout=120, poll=0.05)
    proc = slurm.run("scancel", "--batch", "--signal=USR1", str(job_id))
    assert proc.returncode == 0, proc.stderr
    # The script requeued the job; Slurm holds it until its revoked credential expires (cluster.CRED_EXPIRE_S;
    # releasing it earlier, e.g. with StartTime=now, makes Slurm kill the start: "Job credential revoked").
    job = slurm.wait(job_id, timeout=300)
    log = batch_log(run_dir)
    assert (job.state, job.exit_code, job.restarts) == ("COMPLETED", "0:0", 1), log
    assert [c["JobState"] for c in slurm.completions(job_id)][-1] == "COMPLETED"
    assert "stopped with a checkpoint" in log and "requeueing job" in log and "--resume" in log, log
    stop = int(log.split('"step": ')[1].split(",")[0])  # the record rank 0 wrote after the checkpoint
    assert 1 <= stop < STEPS, log  # stopped mid-run, not at its end
    assert (run_dir / "checkpoints" / f"step_{stop:06d}").is_dir()
    assert not (run_dir / RECORD_NAME).exists()  # the resumed run cleared it
    for rank in (0, 1):  # every rank stopped after the same step
        assert f"stopping after step {stop} " in (run_dir / "logs" / f"{job_id}_r0_{rank}.log").read_text()
    assert (run_dir / "logs" / f"{job_id}_r1_0.log").exists()  # the second run's logs apart
    got, want = metrics(run_dir), metrics(ref_dir)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))  # each step once: resumed, not restarted
    for g, w in zip(got, want):
        assert (g["reward_mean"], g["loss"], g["grad_norm"]) == (w["reward_mean"], w["loss"], w["grad_norm"]), g["step"]
    assert all(m["grad_norm"] > 0 for m in got[stop:]), "no update after the stop: the weight check means nothing"
    assert max_diff(hf_weights(run_dir), hf_weights(ref_dir)) == 0.0


def test_convert_jobs_round_trip(slurm, plain_run, tmp_path):
    """hf-to-mcore (TP=2), then mcore-to-hf as a job that waits for it (--dependency)."""
    ref_dir, _ = plain_run
    env = {**job_env(slurm, tmp_path / "unused")}
    first = slurm.sbatch(SCRIPTS / "convert.sbatch", "hf-to-mcore", "--hf", str(ref_dir / "hf"), "--out",
                         str(tmp_path / "mcore"), "--tp", "2", env=env, cwd=tmp_path,
                         options=(f"--output={tmp_path}/to_mcore.out", *SMALL))
    second = slurm.sbatch(SCRIPTS / "convert.sbatch", "mcore-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out",
                          str(tmp_path / "hf"), env=env, cwd=tmp_path,
                          options=(f"--output={tmp_path}/to_hf.out", f"--dependency=afterok:{first}", *SMALL))
    for job_id, name in ((first, "to_mcore"), (second, "to_hf")):
        job = slurm.wait(job_id)
        assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), (tmp_path / f"{name}.out").read_text()
    assert sorted(p.name for p in (tmp_path / "mcore").glob("model_*.safetensors")) == [
        "model_tp0_pp0_ep0.safetensors", "model_tp1_pp0_ep0.safetensors"]
    back = load_file(tmp_path / "hf" / "model.safetensors")
    assert max_diff(back, hf_weights(ref_dir)) == 0.0
    assert all(t.dtype == torch.float32 for t in back.values())


def test_convert_job_rejects_a_bad_direction(slurm, tmp_path):
    job_id = slurm.sbatch(SCRIPTS / "convert.sbatch", "hf-to-megatron", env=job_env(slurm, tmp_path / "x"),
                          cwd=tmp_path, options=(f"--output={tmp_path}/bad.out", *SMALL))
    job = slurm.wait(job_id)
    assert job.state == "FAILED" and job.exit_code == "2:0"
    assert "first argument: hf-to-mcore or mcore-to-hf" in (tmp_path / "bad.out").read_text()
